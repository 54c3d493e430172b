"""The checkpoint flags, named as OpenRLHF's trainers name them, defined once for every trainer.

``learner.supervised.config.TrainerConfig`` (SFT, RM, DPO) inherits ``CheckpointFlags``; what
they mean is ``learner.runtime.checkpoint`` and docs/checkpoints.md. No torch here: the flags
are parsed before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import flag


@dataclass
class CheckpointFlags:
    save_steps: int = flag(
        -1,
        "save a checkpoint (engines, optimizer, LR schedule, run state, RNG; docs/checkpoints.md) every N "
        "optimizer steps (<= 0: never; the final HF model is written to --save_path regardless)",
        group="ckpt",
    )
    ckpt_path: str = flag(
        "",
        "checkpoint directory (default: SAVE_PATH/checkpoints); with --load_checkpoint, one checkpoint in it "
        "(DIR/step_00000012) resumes from exactly that one",
        group="ckpt",
    )
    max_ckpt_num: int = flag(
        3, "keep at most this many checkpoints (older ones go once a new one is complete)", group="ckpt"
    )
    load_checkpoint: bool = flag(
        False,
        "resume from the newest complete checkpoint in --ckpt_path (a damaged one is skipped with a warning); "
        "none there: a fresh start",
        group="ckpt",
    )
    save_hf_ckpt: bool = flag(False, "also write the model in HF format into each checkpoint (hf/)", group="ckpt")

    def __post_init__(self) -> None:
        if self.max_ckpt_num < 1:
            raise ValueError(f"--max_ckpt_num must be >= 1, got {self.max_ckpt_num}")


def checkpoint_location(ckpt_path: str, save_path: str) -> Path:
    """``--ckpt_path``, or ``SAVE_PATH/checkpoints`` when it is empty."""
    return Path(ckpt_path) if ckpt_path else Path(save_path) / "checkpoints"
