"""RolloutCore in-process, on a stand-in for vLLM's AsyncLLM: the admission gate, versions,
pause/resume, weight-update ordering and failure, request validation. Fast: no engine.

The stand-in generates one token per 10 ms while not paused and labels each token with the
engine's current weight version, as vLLM does (``weight_versions`` spans). The real engine is
exercised in ``tests/unit/rollout_service/test_rollout_service.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from common import protocol as P
from common.transport import AsyncEndpoint, Endpoint, free_port
from helpers.fake_controller import welcome_then
from helpers.fake_llm import VOCAB, core_on_fake_llm
from rollout_service.config import RolloutConfig
from rollout_service.core import BadRequest, NotSupported, RolloutCore, engine_args, memory_share


@pytest.fixture
def core():
    c = core_on_fake_llm()
    return c


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


SP = P.SamplingParams(temperature=1.0, max_new_tokens=20)


async def _update(core, version, fail=False):
    core.llm.fail_update = fail
    await core.start_weight_update(version)
    try:
        await core.update_weights(["w"], ["float32"], [[1]])
    finally:
        core.llm.fail_update = False
    return await core.finish_weight_update(version)


def test_in_flight_sample_kept_through_an_update_and_labelled_with_its_start(core):
    async def main():
        first = asyncio.ensure_future(core.generate(1, [1, 2, 3], SP))
        await asyncio.sleep(0.05)  # a few tokens on v0
        reset = await _update(core, 1)
        assert reset is False  # the kept request holds KV: the version salt keeps them apart
        second = await core.generate(2, [1, 2, 3], SP)
        r1 = await first
        (s1,), (s2,) = r1.samples, second.samples
        assert (s1.policy_version, s2.policy_version) == (0, 1)
        assert s1.finish_reason == "length" and len(s1.token_ids) == 20 and s1.logprobs == [-1.5] * 20
        assert core.counters["samples_across_updates"] == 1
        salts = [p.get("cache_salt") for p in core.llm.prompts.values()]
        assert salts == ["rayless-v0", "rayless-v1"]
        assert core.llm.calls == ["pause", "start", "update", "finish", "resume"]

    run(main())


def test_prompts_wait_for_the_version_they_ask_for_and_for_the_welcome_floor(core):
    async def main():
        want2 = asyncio.ensure_future(core.generate(1, [5], SP, min_version=2))
        core.admit_from(1)
        floor = asyncio.ensure_future(core.generate(2, [5], SP))
        await asyncio.sleep(0.1)
        assert not core.llm.prompts and core.metrics()["waiting"] == 2
        await _update(core, 1)
        assert (await floor).samples[0].policy_version == 1
        assert not want2.done()
        await _update(core, 2)
        assert (await want2).samples[0].policy_version == 2

    run(main())


def test_pause_holds_new_prompts_and_resume_releases_them(core):
    async def main():
        await core.pause()
        assert core.state == "paused"
        task = asyncio.ensure_future(core.generate(1, [5], SP))
        await asyncio.sleep(0.1)
        assert not task.done() and not core.llm.prompts
        await core.resume()
        assert core.state == "serving"
        await task

    run(main())


def test_a_failed_update_gates_the_server_until_a_full_update_lands(core):
    async def main():
        with pytest.raises(RuntimeError, match="Connection reset"):
            await _update(core, 1, fail=True)
        assert core.state == "update_failed" and core.version == 0
        task = asyncio.ensure_future(core.generate(1, [5], SP))
        await asyncio.sleep(0.1)
        assert not task.done()  # half-loaded weights serve nothing
        await _update(core, 1)
        assert core.state == "serving" and (await task).samples[0].policy_version == 1

    run(main())


def test_a_controller_lost_mid_push_frees_the_engine_for_the_next_one(core):
    """The learner dies inside a push: its receive fails (gloo sees the peer's sockets close),
    its queued Finish is refused, the open update is failed and the group dropped, and the next
    learner forms a group and lands a full update at once."""

    async def main():
        await core.init_weight_transfer("gloo", {"master_port": 1}, 30.0)
        await core.start_weight_update(1)
        receiving = asyncio.Event()

        async def receive_until_the_learner_dies(request):
            receiving.set()
            await asyncio.sleep(0.1)
            core.llm.session = False  # vLLM's worker ends the session on a failed receive
            raise RuntimeError("Connection closed by peer")

        core.llm.update_weights = receive_until_the_learner_dies
        update = asyncio.ensure_future(core.update_weights(["w"], ["float32"], [[1]]))
        await receiving.wait()
        finish = asyncio.ensure_future(core.finish_weight_update(1))  # sent before the kill, queued
        await asyncio.sleep(0)
        await core.abort_weight_sync("the controller went away")
        with pytest.raises(RuntimeError, match="closed by peer"):
            await update
        with pytest.raises(BadRequest, match="gone away"):
            await finish
        assert core.state == "update_failed" and core.llm.calls[-1] == "shutdown"
        del core.llm.update_weights
        await core.init_weight_transfer("gloo", {"master_port": 2}, 30.0)
        assert 0 < core.llm.init_info["rendezvous_timeout_s"] <= 30.0
        await _update(core, 1)
        assert core.state == "serving" and core.version == 1

    run(main())


def test_an_update_left_open_by_a_gone_controller_is_failed_not_kept(core):
    async def main():
        await core.start_weight_update(1)  # killed before its WeightUpdate
        await core.abort_weight_sync("a new controller session began")
        assert core.state == "update_failed" and core.weights.counters["failed_updates"] == 1
        await core.init_weight_transfer("gloo", {}, 30.0)  # not "a weight update is open"
        await _update(core, 1)
        assert core.state == "serving"

    run(main())


def test_a_group_init_that_waited_out_the_learners_deadline_is_refused_at_once(core):
    async def main():
        async def slow_finish(weight_version=None):
            await asyncio.sleep(1.2)

        core.llm.finish_weight_update = slow_finish
        await core.start_weight_update(1)
        finish = asyncio.ensure_future(core.finish_weight_update(1))
        await asyncio.sleep(0)
        with pytest.raises(TimeoutError, match="gave up on this group"):
            await core.init_weight_transfer("gloo", {}, 1.5)
        await finish
        assert "init" not in core.llm.calls  # never sent a worker to a dropped store

    run(main())


def test_bad_requests_are_refused_before_reaching_the_engine(core):
    async def main():
        with pytest.raises(BadRequest, match="vocabulary"):
            await core.generate(1, [1, VOCAB], SP)
        with pytest.raises(BadRequest, match="max_model_len"):
            await core.generate(2, [1] * 64, SP)
        with pytest.raises(BadRequest, match="without WeightUpdateStart"):
            await core.update_weights(["w"], ["float32"], [[1]])
        with pytest.raises(BadRequest, match="without WeightUpdateStart"):
            await core.finish_weight_update(3)
        with pytest.raises(BadRequest, match="--weight_transfer_backend 'gloo'"):
            await core.init_weight_transfer("nccl", {}, 1.0)
        await core.start_weight_update(1)
        with pytest.raises(BadRequest, match="already open"):
            await core.start_weight_update(1)
        with pytest.raises(NotSupported, match="sleep"):
            await core.sleep(1)
        assert not core.llm.prompts

    run(main())


def test_sample_batch_is_columnar_over_prompts_and_samples():
    from rollout_service.core import GeneratedSample, PromptResult
    from rollout_service.server import sample_batch

    results = [
        PromptResult(
            7,
            [1, 2],
            [GeneratedSample([5, 6, 7], [-0.1, -0.2, -0.3], "length", 3), GeneratedSample([8], [-0.4], "stop", 3)],
        ),
        PromptResult(9, [4], [GeneratedSample([], [], "abort", 4)]),
    ]
    b = P.Codec().decode(P.Codec().encode(sample_batch(results, "r0")))  # what the controller gets
    assert (b.prompt_ids, b.sample_indices, b.response_lengths) == ([7, 7, 9], [0, 1, 0], [3, 1, 0])
    assert b.response_ids.tolist() == [5, 6, 7, 8] and b.logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert (b.finish_reasons, b.policy_versions, b.server) == (["length", "stop", "abort"], [3, 3, 4], "r0")
    no_lp = sample_batch([PromptResult(1, [1], [GeneratedSample([5], None, "stop", 0)])], "r0")
    assert no_lp.logprobs is None


def test_cpu_engine_prefills_whole_prompts(tiny_model_dir):
    """vLLM 0.32 on CPU kills the engine when a seeded request is chunk-prefilled (its CPU
    generator cannot rewind); the server keeps chunked prefill off there unless told otherwise."""
    cfg = dict(model=str(tiny_model_dir), controller="tcp://127.0.0.1:1", weight_transfer_backend="gloo")
    assert engine_args(RolloutConfig(**cfg)).enable_chunked_prefill is False
    on = engine_args(RolloutConfig(**cfg, enable_chunked_prefill=True))
    assert on.enable_chunked_prefill is True


def _failing_starts(monkeypatch, refused: str | None) -> list[int]:
    """vLLM's AsyncLLM made to fail every start as a worker's exception does from its own
    process ("Engine core initialization failed"), and the memory check read after a failure
    made to answer ``refused``. Returns the list the attempts are counted in."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollout_service import core as core_module

    attempts: list[int] = []

    def from_engine_args(args, **kw):
        attempts.append(1)
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(from_engine_args))
    monkeypatch.setattr(core_module, "check_start", lambda *a, **k: None)  # the check before passed
    monkeypatch.setattr(core_module, "start_refusal", lambda *a, **k: refused)
    return attempts


def test_an_engine_refused_for_memory_is_not_started_again(tiny_model_dir, monkeypatch):
    """vLLM-CPU's memory refusal comes from its worker's process; read again, the check says so:
    one EngineStartRefused with that line, after one attempt, not three retries of a traceback."""
    from common.vllm_memory import EngineStartRefused

    attempts = _failing_starts(
        monkeypatch, refused="r0: vLLM-CPU will not start: ... pass --gpu_memory_utilization 0.5"
    )
    cfg = RolloutConfig(model=str(tiny_model_dir), controller="tcp://127.0.0.1:1", gpu_memory_utilization=0.85)
    with pytest.raises(EngineStartRefused, match="pass --gpu_memory_utilization 0.5"):
        run(RolloutCore.create(cfg))
    assert len(attempts) == 1


def test_a_start_failure_that_memory_does_not_explain_is_retried(tiny_model_dir, monkeypatch):
    attempts = _failing_starts(monkeypatch, refused=None)  # e.g. vLLM 0.32's input-thread assert on a busy host
    cfg = RolloutConfig(model=str(tiny_model_dir), controller="tcp://127.0.0.1:1", engine_start_attempts=2)
    with pytest.raises(RuntimeError, match="initialization failed"):
        run(RolloutCore.create(cfg))
    assert len(attempts) == 2


def test_an_explicit_share_wins_and_is_announced(tiny_model_dir):
    cfg = dict(model=str(tiny_model_dir), controller="tcp://127.0.0.1:1", weight_transfer_backend="gloo")
    assert engine_args(RolloutConfig(**cfg, gpu_memory_utilization=0.3)).gpu_memory_utilization == 0.3
    assert core_on_fake_llm(gpu_memory_utilization=0.3).capabilities().gpu_memory_utilization == 0.3
    share = engine_args(RolloutConfig(**cfg)).gpu_memory_utilization  # on CPU: weights + KV + runtime, far below 0.85
    assert 0 < share < 0.85 and memory_share(RolloutConfig(**cfg)) == share


# ---------------------------------------------------------------------------- the server's shell
# RolloutServer in-process on the stand-in engine, the test as the controller: how the server
# wears common/service.py's shell (last words, signal -> exit code, Shutdown -> Ack).


def serve_in_process(core, act) -> tuple[int, list[P.Message]]:
    """Serves ``core`` in the main thread (only there may asyncio catch signals) against a
    controller thread that welcomes it, calls ``act(router, identity)`` after the first
    heartbeat, and records what it gets until an Ack or a fatal notice."""
    from rollout_service.server import RolloutServer

    router = Endpoint.bind("tcp://127.0.0.1:0")
    cfg = RolloutConfig(model="m", controller=router.address, heartbeat_s=0.2, weight_transfer_backend="gloo")
    seen: list[P.Message] = []

    async def main() -> int:
        ep = AsyncEndpoint(router.address, name="r-shell")
        try:
            return await asyncio.wait_for(RolloutServer(cfg, core, ep).serve(), 20)
        finally:
            ep.close(0)

    t = welcome_then(router, act, seen)
    try:
        return asyncio.run(main()), seen
    finally:
        t.join(20)
        router.close(0)


def _fatal(seen):
    return [m for m in seen if isinstance(m, P.Error) and m.code == "fatal"]


def test_server_on_sigterm_says_last_words_and_exits_143(core, restore_signal_handlers):
    rc, seen = serve_in_process(core, lambda _r, _ident: os.kill(os.getpid(), signal.SIGTERM))
    assert rc == 143 and [m.message for m in _fatal(seen)] == ["r-shell stopping on SIGTERM"]


def test_server_with_a_dead_engine_says_so_and_exits_1(core, restore_signal_handlers):
    rc, seen = serve_in_process(core, lambda _r, _ident: setattr(core.llm, "errored", True))
    assert rc == 1 and [m.message for m in _fatal(seen)] == ["r-shell: vLLM engine died (see its log above)"]


def test_server_acknowledges_shutdown_and_exits_0(core, restore_signal_handlers):
    rc, seen = serve_in_process(core, lambda r, ident: r.send(P.Shutdown(reason="done", call_id=5), to=ident))
    acks = [m for m in seen if isinstance(m, P.Ack)]
    assert rc == 0 and acks[0].call_id == 5 and acks[0].info == P.ShutdownAccepted(unanswered=0) and not _fatal(seen)


# While no controller is there -- none has welcomed the server yet, or the one that did is gone --
# the server still stops at once when told, and when its engine dies (a real run's server once
# kept saying Hello after a SIGTERM had killed its engine, until SIGKILLed).


def serve_waiting(core, controller: str, when, act) -> tuple[int, float]:
    """Serves ``core`` in the main thread against ``controller``; once ``when(server)`` holds
    (polled from half a second in), calls ``act()``; returns the exit code and the seconds
    from ``act`` to the end of ``serve``."""
    import time

    from rollout_service.server import RolloutServer

    cfg = RolloutConfig(model="m", controller=controller, heartbeat_s=0.2, weight_transfer_backend="gloo")
    acted: list[float] = []

    async def main() -> int:
        ep = AsyncEndpoint(controller, name="r-wait")
        server = RolloutServer(cfg, core, ep)

        async def trigger() -> None:
            await asyncio.sleep(0.5)  # serve() has caught the signals (its first step) and said Hello
            while not when(server):
                await asyncio.sleep(0.05)
            acted.append(time.monotonic())
            act()

        t = asyncio.create_task(trigger())
        try:
            return await asyncio.wait_for(server.serve(), 20)
        finally:
            t.cancel()
            ep.close(0)

    rc = asyncio.run(main())
    return rc, time.monotonic() - acted[0]


def welcome_then_vanish() -> tuple[str, threading.Thread]:
    """A controller that welcomes one Hello and closes its socket at the first heartbeat."""
    router = Endpoint.bind("tcp://127.0.0.1:0")

    def run() -> None:
        try:
            while (got := router.recv(timeout=10)) is not None:
                ident, msg = got
                if isinstance(msg, P.Hello):
                    router.reply(msg, P.Welcome(peer_id=msg.name), to=ident)
                elif isinstance(msg, P.Heartbeat):
                    return
        finally:
            router.close(0)

    t = threading.Thread(target=run)
    t.start()
    return router.address, t


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def test_a_signal_ends_a_server_no_controller_has_welcomed_at_once(core, restore_signal_handlers, caplog):
    caplog.set_level("INFO")
    rc, took = serve_waiting(core, f"tcp://127.0.0.1:{free_port()}", lambda _s: True, _sigterm)
    assert rc == 143 and took < 5.0  # at once (~0 s), not after --connect_timeout_s (120 s); room for a busy host
    assert "r-wait stopping on SIGTERM (no controller had welcomed it)" in caplog.messages
    assert _errors(caplog) == []  # a stop that was asked for


def test_an_engine_that_dies_before_any_welcome_ends_the_server_in_one_line(core, restore_signal_handlers, caplog):
    rc, took = serve_waiting(
        core, f"tcp://127.0.0.1:{free_port()}", lambda _s: True, lambda: setattr(core.llm, "errored", True)
    )
    assert rc == 1 and took < 5.0  # the engine is read every ENGINE_WATCH_S
    (error,) = _errors(caplog)
    assert error.startswith("r-wait: the vLLM engine died while waiting for the controller at tcp://127.0.0.1:")


@pytest.mark.parametrize("event", ["signal", "engine death"])
def test_a_server_waiting_for_a_gone_controller_still_stops(core, restore_signal_handlers, caplog, event):
    """Reconnecting (the controller went away after welcoming it): SIGTERM -> 143, a dead engine
    -> 1 (noticed between two Hellos, ~2 s), each after the last words' deadline (nobody hears
    them), not after --reconnect_timeout_s (1800 s)."""
    from common.service import FATAL_SEND_S, RECONNECT_SEND_S

    caplog.set_level("INFO")
    address, controller = welcome_then_vanish()
    act = _sigterm if event == "signal" else (lambda: setattr(core.llm, "errored", True))
    try:
        rc, took = serve_waiting(core, address, lambda server: server.shell.lost, act)
    finally:
        controller.join(10)
    assert rc == (143 if event == "signal" else 1) and took < FATAL_SEND_S + 2 * RECONNECT_SEND_S + 5.0
    fatal = [m for m in _errors(caplog) if m.startswith("announcing fatal")]
    assert fatal == ([] if event == "signal" else ["announcing fatal: r-wait: vLLM engine died (see its log above)"])


def test_a_signal_during_engine_start_up_stops_the_engine_it_started(monkeypatch, restore_signal_handlers):
    """vLLM's start-up blocks the loop while it spawns the engine's processes. A SIGTERM then
    must not kill the server alone (the engine's processes would be orphaned, holding their
    memory): it is acted on once start() returns -- the engine shut down, exit 143, no Hello."""
    import time

    from rollout_service import server as server_module

    events = []

    class StartingCore:
        def __init__(self) -> None:
            self.llm: str | None = "engine"

        @classmethod
        async def create(cls, cfg) -> StartingCore:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # still blocking the loop, as AsyncLLM.from_engine_args does
            events.append("started")
            return cls()

        async def shutdown(self) -> None:
            events.append(f"shutdown {self.llm}")
            self.llm = None

    def no_endpoint(*a, **k):
        raise AssertionError("the server said Hello after a SIGTERM during start-up")

    monkeypatch.setattr(server_module, "RolloutCore", StartingCore)
    monkeypatch.setattr(server_module, "AsyncEndpoint", no_endpoint)
    cfg = RolloutConfig(model="m", controller="tcp://127.0.0.1:1")
    assert run(server_module.amain(cfg)) == 143
    assert events == ["started", "shutdown engine"]


def test_aliases_reach_a_receiver_of_ours_and_are_refused_by_vllms_own(core):
    """WeightUpdate.aliases (a tied lm_head sent once) go to our gloo receiver; vLLM's own NCCL
    receiver cannot load them, so such an update is refused and the server gated."""
    seen = []

    async def update_weights(request):
        seen.append(request.update_info)

    core.llm.update_weights = update_weights
    aliases = {"lm_head.weight": "w"}
    run(core.start_weight_update(1))
    run(core.update_weights(["w"], ["float32"], [[1]], aliases))
    assert seen[-1]["aliases"] == aliases
    run(core.finish_weight_update(1))
    nccl = core_on_fake_llm(weight_transfer_backend="nccl")
    run(nccl.start_weight_update(2))
    with pytest.raises(BadRequest, match="aliases: the nccl receiver cannot load them"):
        run(nccl.update_weights(["w"], ["float32"], [[1]], aliases))
    assert nccl.state == "update_failed" and nccl.weights.incomplete
