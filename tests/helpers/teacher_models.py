"""Teachers for the distillation tests: the tiny model (common/tiny.py) with perturbed weights,
and one whose tokenizer differs from the tiny model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def build_perturbed_teacher(tiny_model_dir, out: Path, *, scale: float = 0.5, seed: int = 7) -> Path:
    """The tiny model, every weight plus ``scale`` x its own std x N(0, 1) noise, with the tiny
    model's tokenizer: a teacher whose next-token distributions differ from the student's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    g = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # matrices (norm scales stay: a teacher that still works)
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def build_foreign_tokenizer_teacher(tiny_model_dir, out: Path) -> Path:
    """The tiny model with a tokenizer in which two tokens swapped ids: same size, another map."""
    shutil.copytree(tiny_model_dir, out)
    tok_file = out / "tokenizer.json"
    tok = json.loads(tok_file.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_file.write_text(json.dumps(tok))
    for extra in ("vocab.json",):  # a slow tokenizer's files, if saved, must agree
        f = out / extra
        if f.exists():
            v = json.loads(f.read_text())
            v[a], v[b] = v[b], v[a]
            f.write_text(json.dumps(v))
    return out
