"""Two ranks (gloo, no DeepSpeed) through learner.runtime.checkpoint; each writes
``result_rank{r}.json`` into the folder it is given.

Run under ``torchrun --standalone --nproc_per_node 2 tests/helpers/checkpoint_ranks.py CKPT_DIR``.
Each rank's stand-in engine writes its own shard (as ZeRO does), rank 0 alone holds a "driver"
part (as the RL run's rank 0 does). The ranks save steps 2 and 4, then:

1. rank 1's shard of step 4 is truncated: both ranks skip step 4 and resume step 2;
2. rank 0's driver refuses the checkpoint (its data changed): both ranks raise, none hangs in
   the engines' load, rank 1 naming rank 0's reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from learner.runtime import checkpoint as R
from learner.runtime import checkpoint_manifest as manifest


class ShardEngine:
    def __init__(self, rank: int, value: float) -> None:
        self.rank, self.w = rank, torch.full((1000,), value)

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict) -> None:
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save(self.w, d / f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt")

    def load_checkpoint(self, load_dir: str, tag: str, **kw):
        self.w = torch.load(Path(load_dir) / tag / f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt")
        return load_dir, {}


class Part:
    def __init__(self, value: int, refuse: bool = False) -> None:
        self.value, self.refuse = value, refuse

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if self.refuse:
            raise ValueError("the data changed")
        self.value = state["value"]


def checkpointer(root: Path, rank: int, value: float, *, refuse: bool = False):
    engine, kl, driver = ShardEngine(rank, value), Part(int(value)), Part(int(value), refuse)
    ckpt = R.Checkpointer(root, match={"seed": 0})
    ckpt.add_engine("policy", engine)
    ckpt.add_state("kl", kl)
    if rank == 0:
        ckpt.add_state("driver", driver)
    return ckpt, engine, kl, driver


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checkpointer(root, rank, 2.0)[0].save(2)
    checkpointer(root, rank, 4.0)[0].save(4)
    files = manifest.read(root / "step_00000004")
    if rank == 1:
        shard = root / "step_00000004" / "policy" / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.write_bytes(shard.read_bytes()[:100])
    dist.barrier()

    ckpt, engine, kl, _ = checkpointer(root, rank, 0.0)
    resumed = ckpt.resume()
    result = {
        "rank": rank,
        "manifest": {name: sorted(entry) for name, entry in files.items()},
        "resumed_step": resumed.step,
        "engine_value": float(engine.w[0]),
        "kl_value": kl.value,
    }
    try:
        checkpointer(root, rank, 0.0, refuse=True)[0].resume()
    except R.CheckpointError as e:
        result["refused"] = str(e)
    dist.barrier()
    # A file per rank: two ranks printing to one pipe can interleave their lines.
    (root / f"result_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
