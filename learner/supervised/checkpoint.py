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
    hf/         with --ckpt.save_hf (--save_hf_ckpt), the model in HF format (never read back)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.config import get
from learner.runtime import checkpoint as R
from learner.supervised.config import TrainerConfig

# What the data order, the shards and the meaning of "optimizer step k" depend on, under the
# name each is saved with in a checkpoint (the flat flag names of the first release: checkpoints
# written before the config had sections still resume) -> where it is read in the config. The
# learning rate, logging, evaluation and packing (the same samples per micro-batch, packed or
# padded) may change across a restart. The number of ranks is always matched.
MATCH_FIELDS = {
    "pretrain": "model.model_name_or_path",
    "dataset": "data.dataset",
    "dataset_probs": "data.dataset_probs",
    "dataset_split": "data.dataset_split",
    "max_samples": "data.max_samples",
    "max_len": "data.max_len",
    "seed": "train.seed",
    "train_batch_size": "train.batch_size",
    "micro_train_batch_size": "train.micro_batch_size",
    "zero_stage": "ds.zero_stage",
    # LoRA: the adapters' shapes and what they mean (their scale is alpha / rank)
    "lora_rank": "ds.lora.rank",
    "lora_alpha": "ds.lora.alpha",
    "target_modules": "ds.lora.target_modules",
}


def match_fields(cfg: TrainerConfig, trainer: str, n_train: int) -> dict[str, Any]:
    fields = {name: get(cfg, path) for name, path in MATCH_FIELDS.items()}
    fields["trainer"] = trainer  # an SFT checkpoint is no DPO run's
    fields["n_train"] = n_train  # the same rows kept after encoding and --data.max_len
    return fields


def check_resumable(cfg: TrainerConfig, trainer: str, n_train: int) -> Path | None:
    """With --ckpt.load_enable, before the model loads: the checkpoint the resume will load
    (None: a fresh start), verified and checked against this run. Raises CheckpointError."""
    if not cfg.ckpt.load_enable:
        return None
    return R.check_resumable(cfg.ckpt.location, match_fields(cfg, trainer, n_train))


def trainer_checkpointer(cfg: TrainerConfig, trainer: Any, tokenizer: Any, n_train: int) -> R.Checkpointer:
    """The checkpointer of a ``learner.supervised.trainer.Trainer`` with its parts registered."""
    ckpt = R.Checkpointer(
        cfg.ckpt.location,
        max_keep=cfg.ckpt.max_num,
        match=match_fields(cfg, trainer.name, n_train),
    )
    ckpt.add_engine("model", trainer.engine)
    ckpt.add_state("trainer", trainer)
    if trainer.metrics is not None:
        ckpt.add_state("metrics", trainer.metrics)
    if cfg.ckpt.save_hf:
        from learner.runtime import engine as E

        ckpt.add_export("hf", lambda d: E.save_hf(trainer.engine, tokenizer, d))
    return ckpt
