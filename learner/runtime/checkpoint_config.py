"""The checkpoint flags, named as OpenRLHF's trainers name them, defined once for every trainer.

``CkptSection`` is the ``ckpt`` section of every trainer's config; what they mean is
``learner.runtime.checkpoint`` and docs/checkpoints.md. No torch here: the flags
are parsed before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import flag


@dataclass
class CkptSection:
    """Checkpoints and where the final model goes (OpenRLHF's ``ckpt.*``). What they mean:
    ``learner.runtime.checkpoint`` and docs/checkpoints.md. The RL trainer counts ``save_steps`` in
    rollout steps, the supervised ones in optimizer steps."""

    output_dir: str = flag("./ckpt", "where the final HF-format model (and its logs) are written", flat="save_path")
    save_steps: int = flag(
        -1,
        "save a checkpoint (engines, optimizer, LR schedule, run state, RNG; docs/checkpoints.md) every N "
        "steps (<= 0: never; the final HF model is written to --ckpt.output_dir regardless)",
        flat="save_steps",
    )
    path: str = flag(
        "",
        "checkpoint directory (default: OUTPUT_DIR/checkpoints); with --ckpt.load_enable, one checkpoint in it "
        "(DIR/step_00000012) resumes from exactly that one",
        flat="ckpt_path",
    )
    max_num: int = flag(
        3, "keep at most this many checkpoints (older ones go once a new one is complete)", flat="max_ckpt_num"
    )
    max_mem: float = flag(
        float("inf"),
        "size cap of the checkpoint directory in GB",
        flat="max_ckpt_mem",
        inert="rayless keeps --ckpt.max_num checkpoints; a size cap is not built",
    )
    load_enable: bool = flag(
        False,
        "resume from the newest complete checkpoint in --ckpt.path (a damaged one is skipped with a warning); "
        "none there: a fresh start",
        flat="load_checkpoint",
    )
    save_hf: bool = flag(False, "also write the model in HF format into each checkpoint (hf/)", flat="save_hf_ckpt")

    def __post_init__(self) -> None:
        if self.max_num < 1:
            raise ValueError(f"--ckpt.max_num (--max_ckpt_num) must be >= 1, got {self.max_num}")

    @property
    def location(self) -> Path:
        """``--ckpt.path``, or ``OUTPUT_DIR/checkpoints`` when it is empty."""
        return checkpoint_location(self.path, self.output_dir)


def checkpoint_location(ckpt_path: str, save_path: str) -> Path:
    """``--ckpt_path``, or ``SAVE_PATH/checkpoints`` when it is empty."""
    return Path(ckpt_path) if ckpt_path else Path(save_path) / "checkpoints"
