"""Tiny reward models for the reward-service tests, built from the tiny policy (common/tiny.py)."""

from pathlib import Path

import torch


def build_tiny_rm(tiny_model_dir, out: Path, seed: int = 1) -> Path:
    """An HF sequence-classification RM: the tiny model's backbone + a fresh 1-output score head."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.save_pretrained(out)
    return out
