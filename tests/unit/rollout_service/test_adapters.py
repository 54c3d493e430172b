"""AdapterRegistry alone, on a recording stand-in engine: an adapter is written, loaded, served
to the requests admitted while it is current, and removed (engine and folder) once no request
uses it and another is served; what is refused names the flag."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common import protocol as P
from rollout_service.adapters import AdapterRegistry
from rollout_service.errors import BadRequest

LORA = P.LoraAdapter(rank=4, alpha=8.0, target_modules=["q_proj"])


class AdapterEngine:
    """What the registry calls: the first worker writes the folder; add/remove are recorded."""

    def __init__(self) -> None:
        self.added: list[int] = []
        self.removed: list[int] = []

    async def collective_rpc(self, method, args=()):
        assert method == "rayless_receive_adapter"
        info, folder, lora, whole = args
        Path(folder).mkdir(parents=True)
        (Path(folder) / "adapter_config.json").write_text(str(lora["rank"]))
        return [None]

    async def add_lora(self, req) -> bool:
        self.added.append(req.lora_int_id)
        return True

    async def remove_lora(self, lora_id: int) -> None:
        self.removed.append(lora_id)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def push(reg: AdapterRegistry, version: int):
    await reg.receive({"names": ["a"]}, LORA, whole=False)
    lora = await reg.load_pending(version)
    reg.serve(lora)
    await reg.retire()
    return lora


def test_an_adapter_in_use_outlives_the_next_push_and_goes_with_its_last_request(tmp_path):
    engine = AdapterEngine()
    reg = AdapterRegistry(enabled=True, max_lora_rank=8, root=tmp_path, engine=lambda: engine)

    async def main():
        first = await push(reg, 1)
        held = reg.acquire()  # a request admitted on v1
        assert held is first
        second = await push(reg, 2)
        assert engine.removed == [] and set(reg.folders()) == {1, 2}  # v1's request still runs
        reg.release(held)
        await asyncio.sleep(0.01)  # its retirement runs as a task
        assert engine.removed == [first.lora_int_id] and set(reg.folders()) == {second.lora_int_id}
        assert [p.name for p in tmp_path.iterdir()] == ["adapter-2"]

    run(main())
    assert reg.counters["adapters"] == 2 and engine.added == [1, 2]
    reg.close()
    assert tmp_path.exists() and not any(tmp_path.iterdir())  # --lora_dir is the user's: emptied, kept


def test_whole_weights_without_an_adapter_serve_the_weights_alone():
    engine = AdapterEngine()
    reg = AdapterRegistry(enabled=True, max_lora_rank=8, root=None, engine=lambda: engine)
    run(push(reg, 1))
    root = next(iter(reg.folders().values())).parent  # a temporary folder of ours
    reg.serve(None)
    run(reg.retire())
    assert reg.acquire() is None and engine.removed == [1] and reg.folders() == {}
    reg.close()
    assert not root.exists()


def test_refusals_name_the_flag_and_a_dropped_adapter_leaves_no_folder(tmp_path):
    off = AdapterRegistry(enabled=False, max_lora_rank=8, root=tmp_path, engine=AdapterEngine)
    with pytest.raises(BadRequest, match="without --enable_lora"):
        run(off.receive({}, LORA, whole=False))
    small = AdapterRegistry(enabled=True, max_lora_rank=2, root=tmp_path, engine=AdapterEngine)
    with pytest.raises(BadRequest, match="rank 4 over this server's --max_lora_rank 2"):
        run(small.receive({}, LORA, whole=False))
    reg = AdapterRegistry(enabled=True, max_lora_rank=8, root=tmp_path, engine=AdapterEngine)
    run(reg.receive({}, LORA, whole=True))
    assert reg.has_pending and any(tmp_path.iterdir())
    reg.drop_pending()  # the update that brought it failed
    assert not reg.has_pending and not any(tmp_path.iterdir())
