"""Two rules the checkpoint code applies: which checkpoints a run keeps, and which it can resume from.

- ``retained``: after a save, the newest ``--max_ckpt_num`` checkpoints stay, and so does the one
  whose evaluation scored best (``--best_metric_key``, higher is better; OpenRLHF's rule): a
  checkpoint is scored by the evaluation at its own step, of its own weights. Checkpoints at
  steps without an evaluation are not ranked.
- ``not_resumable``: a checkpoint saved with ``--disable_ds_ckpt`` holds the policy in HF format
  and the run state, but no DeepSpeed states (optimizer moments, LR schedule, the critic's
  engine); resuming from it would be a different run that claims to be the same one, so
  ``--load_checkpoint`` refuses it and says what to do instead. The run state records which kind
  a checkpoint is under ``DEEPSPEED_STATES``.

Pure functions over steps and run-state dicts: torch-free, testable by hand, and independent of
how the checkpoint manager lays its files out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

DEEPSPEED_STATES = "deepspeed_states"  # run-state key: False in a --disable_ds_ckpt checkpoint


def retained(steps: Sequence[int], *, max_num: int, scores: Mapping[int, float] | None = None) -> set[int]:
    """The checkpoint steps to keep: the newest ``max_num`` and the best-scored one (the highest
    score; the earliest of equal ones: a later checkpoint must do better to replace it)."""
    if max_num < 1:
        raise ValueError(f"--max_ckpt_num must be >= 1, got {max_num}")
    keep = set(sorted(steps)[-max_num:])
    if scores:
        ranked = [s for s in steps if s in scores]
        if ranked:
            keep.add(max(ranked, key=lambda s: (scores[s], -s)))
    return keep


def not_resumable(run_state: Mapping[str, Any]) -> str | None:
    """Why ``--load_checkpoint`` cannot continue from a checkpoint with this run state (None: it can)."""
    if run_state.get(DEEPSPEED_STATES, True) is False:
        return (
            "it was saved with --disable_ds_ckpt: it holds the policy in HF format (hf/) but no DeepSpeed "
            "states (optimizer, LR schedule, critic), so training cannot continue exactly from it. Start a new run "
            "from its weights (--pretrain <checkpoint>/hf), or resume from a checkpoint saved without "
            "--disable_ds_ckpt (point --ckpt_path at it)"
        )
    return None
