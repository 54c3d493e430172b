"""WeightSession alone: the order of a push's steps, what a failure leaves, the epoch, and what
it asks of the gate (a recording stand-in, not the core) and of the adapter registry. On the
stand-in engine (``helpers.fake_llm.FakeLLM``); the same steps through the core are in
``test_rollout_core.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from common import protocol as P
from helpers.fake_llm import FakeLLM
from rollout_service.adapters import AdapterRegistry
from rollout_service.errors import BadRequest
from rollout_service.weight_session import WeightSession


class RecordingGate:
    """The gate as the session sees it; records what it is asked."""

    def __init__(self) -> None:
        self.asked: list[tuple] = []
        self.holds: set[str] = set()

    async def hold(self, reason: str) -> None:
        self.asked.append(("hold", reason))
        self.holds.add(reason)

    def swap_hold(self, old: str, new: str) -> None:
        self.asked.append(("swap", old, new))
        self.holds.discard(old)
        self.holds.add(new)

    async def serve_version(self, version: int) -> None:
        self.asked.append(("serve", version))
        self.holds -= {"update", "update_failed"}


def session(enable_lora: bool = False, backend: str = "gloo"):
    llm, gate = FakeLLM(), RecordingGate()
    adapters = AdapterRegistry(enabled=enable_lora, max_lora_rank=8, root=None, engine=lambda: llm)
    s = WeightSession(backend=backend, workers=2, engine=lambda: llm, gate=gate, adapters=adapters)
    return s, llm, gate, adapters


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def push(s: WeightSession, version: int) -> bool:
    await s.start(version)
    await s.update(["w"], ["float32"], [[1]])
    return await s.finish(version)


def test_a_push_holds_the_gate_and_serves_its_version_at_finish():
    s, llm, gate, _ = session()
    assert run(s.init("gloo", {"rendezvous_timeout_s": 5.0}, 30.0)) == 2  # the ranks it brings
    assert llm.init_info["rendezvous_timeout_s"] == 5.0  # the learner's shorter deadline kept
    assert run(push(s, 1)) is True  # nothing in flight: the prefix cache was reset
    assert gate.asked == [("hold", "update"), ("serve", 1)]
    assert llm.calls == ["init", "start", "update", "finish"] and llm.version == "1"
    assert s.counters == {"updates": 1, "failed_updates": 0} and not s.incomplete


def test_a_failed_receive_keeps_the_gate_closed_and_refuses_an_adapter_only_push():
    s, llm, gate, _ = session(enable_lora=True)
    llm.fail_update = True
    run(s.start(1))
    with pytest.raises(RuntimeError, match="Connection reset"):
        run(s.update(["w"], ["float32"], [[1]]))
    assert gate.asked[-1] == ("swap", "update", "update_failed") and gate.holds == {"update_failed"}
    assert s.incomplete and s.counters["failed_updates"] == 1 and llm.calls[-1] == "abandon"
    with pytest.raises(BadRequest, match="without WeightUpdateStart"):
        run(s.finish(1))
    with pytest.raises(BadRequest, match="incomplete after a failed update; push them whole"):
        run(s.start(2, adapter_only=True))
    llm.fail_update = False
    run(push(s, 2))
    assert not s.incomplete and gate.holds == set()


def test_an_abort_refuses_the_gone_controllers_queued_calls_and_drops_its_group():
    s, llm, gate, _ = session()

    async def main():
        await s.init("gloo", {}, 30.0)
        await s.start(1)
        receiving = asyncio.Event()

        async def receive_until_the_learner_dies(request):
            receiving.set()
            await asyncio.sleep(0.1)
            llm.session = False  # vLLM's worker ends the session on a failed receive
            raise RuntimeError("Connection closed by peer")

        llm.update_weights = receive_until_the_learner_dies
        update = asyncio.ensure_future(s.update(["w"], ["float32"], [[1]]))
        await receiving.wait()
        finish = asyncio.ensure_future(s.finish(1))  # the old controller's, queued behind the receive
        await asyncio.sleep(0)
        await s.abort("the controller went away")
        with pytest.raises(RuntimeError, match="closed by peer"):
            await update
        with pytest.raises(BadRequest, match="gone away"):
            await finish
        assert s.incomplete and llm.calls == ["init", "start", "abandon", "shutdown"]
        assert gate.holds == {"update_failed"} and s.counters["failed_updates"] == 1

    run(main())


def test_an_adapter_only_push_holds_nothing_and_serves_the_adapter(tmp_path):
    s, llm, gate, adapters = session(enable_lora=True)
    written = []

    async def collective_rpc(method, args=()):
        assert method == "rayless_receive_adapter"
        info, folder, lora, whole = args
        written.append((folder, whole))
        return [None]

    async def add_lora(req):
        return True

    llm.collective_rpc, llm.add_lora = collective_rpc, add_lora

    async def main():
        await s.start(1, adapter_only=True)
        lora = P.LoraAdapter(rank=4, alpha=8.0, target_modules=["q_proj"])
        await s.update(["a"], ["float32"], [[1]], lora=lora)
        with pytest.raises(BadRequest, match="adapter-only update"):
            await s.update(["w"], ["float32"], [[1]])  # whole weights in an adapter-only update
        assert s.incomplete  # ... failed it

    run(main())
    assert gate.asked == [("swap", "update", "update_failed")]  # no pause for an adapter: only the failure
    assert written[0][1] is False and not adapters.has_pending  # the failed update's adapter dropped
    s2, llm2, gate2, adapters2 = session(enable_lora=True)
    llm2.collective_rpc, llm2.add_lora = collective_rpc, add_lora

    async def ok():
        await s2.start(3, adapter_only=True)
        await s2.update(["a"], ["float32"], [[1]], lora=P.LoraAdapter(rank=4, alpha=8.0, target_modules=["q"]))
        return await s2.finish(3)

    assert run(ok()) is False  # the weights' KV left alone
    assert gate2.asked == [("serve", 3)] and adapters2.current is not None
    assert adapters2.current.lora_name.startswith("rayless-v3-") and "finish" not in llm2.calls


def test_a_server_without_enable_lora_refuses_an_adapter_and_names_the_flag():
    s, _, _, _ = session(enable_lora=False)
    with pytest.raises(BadRequest, match="without --enable_lora"):
        run(s.start(1, adapter_only=True))
    run(s.start(1))
    lora = SimpleNamespace(rank=4)
    with pytest.raises(BadRequest, match="without --enable_lora"):
        run(s.update(["a"], ["float32"], [[1]], lora=lora))
    assert s.incomplete


def test_an_encoded_push_goes_through_the_workers_base_and_a_digest_mismatch_serves_nothing(caplog):
    """--weight_sync delta: the update is the worker extension's rayless_receive_encoded (tied
    names passed to it, never to the engine); a digest mismatch there fails the update like a
    broken receive (gate kept closed, incomplete) and is logged as such."""
    import logging

    from common.weights.delta import DigestMismatch

    s, llm, gate, _ = session()
    rpcs: list[tuple] = []
    plain = llm.collective_rpc

    async def collective_rpc(method, args=()):
        if method != "rayless_receive_encoded":
            return await plain(method, args)
        rpcs.append((method, *args))
        if args[1] == "delta":
            llm.session = False
            raise DigestMismatch("delta push: 1 of 5 tensors differ from what the learner sent after applying it (w)")
        return [1]

    llm.collective_rpc = collective_rpc
    run(s.start(1))
    run(s.update(["w", "#digest"], ["float32", "int64"], [[1], [1]], {"t": "w"}, None, "full"))
    run(s.finish(1))
    assert rpcs[0][2] == "full" and rpcs[0][1]["aliases"] == {"t": "w"} and "update" not in llm.calls
    run(s.start(2))
    with caplog.at_level(logging.ERROR), pytest.raises(DigestMismatch):
        run(s.update(["w#idx", "w#val", "#digest"], ["int32", "float32", "int64"], [[1], [1], [1]], {}, None, "delta"))
    assert "delta weight push failed (serving nothing until a full push lands)" in caplog.text
    assert s.incomplete and gate.holds == {"update_failed"} and llm.calls[-1] == "abandon"
