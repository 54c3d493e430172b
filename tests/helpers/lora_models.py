"""A LoRA (peft) model to push, for the weight-sync tests and ``bench/lora_push.py``."""

from __future__ import annotations

import torch


def lora_model(model_dir, rank: int = 8, alpha: int = 16, b_scale: float = 0.05):
    """The HF model in ``model_dir`` (fp32) with rank-``rank`` adapters on every linear layer
    (``learner.runtime.lora.apply_lora``), B drawn nonzero (peft starts it at 0, which would make
    any merge or adapter look right), in eval mode."""
    from transformers import AutoModelForCausalLM

    from learner.runtime.flags import LoraSection
    from learner.runtime.lora import apply_lora

    lora = LoraSection(rank=rank, alpha=alpha)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_scale)
    return model.eval()
