"""Checkpoints of the SFT, RM and DPO trainers: their parts and the settings a resume must
match. Saving, resuming, the layout, atomicity, manifests and damaged checkpoints are
``learner.runtime.checkpoint``'s, shared with the RL run (docs/checkpoints.md).

The parts (``state.json`` keys, directories)::

    model/      the trained DeepSpeed engine (weights, optimizer, LR schedule); DPO's frozen
                reference is loaded from its flags again, not saved
    trainer     the optimizer step reached (``Trainer.state_dict``): the data position too,
                since each epoch's order is a seeded permutation (``DistributedSampler``)
    metrics     rank 0: where train_log.jsonl stood, so the killed run's later records go
    rng/        per rank (dropout draws from torch's generator)
    hf/         with --save_hf_ckpt, the model in HF format (never read back)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from learner.runtime import checkpoint as R
from learner.runtime.checkpoint_config import checkpoint_location

# What the data order, the shards and the meaning of "optimizer step k" depend on. The learning
# rate, logging, evaluation and packing (the same samples per micro-batch, packed or padded) may
# change across a restart. The number of ranks is always matched.
MATCH_FIELDS = (
    "pretrain",
    "dataset",
    "dataset_probs",
    "dataset_split",
    "max_samples",
    "max_len",
    "seed",
    "train_batch_size",
    "micro_train_batch_size",
    "zero_stage",
    # LoRA: the adapters' shapes and what they mean (their scale is alpha / rank)
    "lora_rank",
    "lora_alpha",
    "target_modules",
)


def match_fields(cfg: Any, trainer: str, n_train: int) -> dict[str, Any]:
    fields = {name: getattr(cfg, name) for name in MATCH_FIELDS}
    fields["trainer"] = trainer  # an SFT checkpoint is no DPO run's
    fields["n_train"] = n_train  # the same rows kept after encoding and --max_len
    return fields


def check_resumable(cfg: Any, trainer: str, n_train: int) -> Path | None:
    """With --load_checkpoint, before the model loads: the checkpoint the resume will load
    (None: a fresh start), verified and checked against this run. Raises CheckpointError."""
    if not cfg.load_checkpoint:
        return None
    return R.check_resumable(checkpoint_location(cfg.ckpt_path, cfg.save_path), match_fields(cfg, trainer, n_train))


def trainer_checkpointer(cfg: Any, trainer: Any, tokenizer: Any, n_train: int) -> R.Checkpointer:
    """The checkpointer of a ``learner.supervised.trainer.Trainer`` with its parts registered."""
    ckpt = R.Checkpointer(
        checkpoint_location(cfg.ckpt_path, cfg.save_path),
        max_keep=cfg.max_ckpt_num,
        match=match_fields(cfg, trainer.name, n_train),
    )
    ckpt.add_engine("model", trainer.engine)
    ckpt.add_state("trainer", trainer)
    if trainer.metrics is not None:
        ckpt.add_state("metrics", trainer.metrics)
    if cfg.save_hf_ckpt:
        from learner.runtime import engine as E

        ckpt.add_export("hf", lambda d: E.save_hf(trainer.engine, tokenizer, d))
    return ckpt
