"""A LoRA-wrapped (peft) model seen as the plain model an engine serves: base names, adapter merged.

The learner trains a ``peft.PeftModel`` (``learner.runtime.lora``); the engines hold the base
architecture and load weights under its checkpoint names. ``plain_parameters`` lists the base
model's parameters under those names, each with the LoRA layer that adapts it (or None), and
``merged_weight`` computes ``W + (alpha / r) * B @ A`` for one of them in fp32, out of place:
the trained tensors are never modified (no merge/unmerge cycle, so no bf16 round-off piles up
in the base weights from one push to the next). The push (``common.weights.source``) and the
learner's saves (``learner.runtime.lora.merged_state_dict``) both build on these two.

A QLoRA base weight (``--ds.load_in_4bit``: bitsandbytes' packed 4-bit ``Params4bit``) is read
through ``dense``, dequantized to the dtype it computes in (``plain_dtype``, ``plain_shape``):
the plain model is the one the learner trains, quantization error included.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def is_peft(module: Any) -> bool:
    if "peft" not in sys.modules:  # no peft model can exist; spares the import
        return False
    from peft import PeftModel

    return isinstance(module, PeftModel)


def plain_parameters(peft_model: Any, *, state_dict: bool = False) -> list[tuple[str, torch.Tensor, Any]]:
    """``(name, parameter, lora_layer or None)`` for every parameter of the base model under its
    plain checkpoint name (``model.layers.0.self_attn.q_proj.weight``), tied ones under each of
    their names, in the base model's order. LoRA's own tensors are left out; a ``modules_to_save``
    module appears once, as its trained copy of the active adapter. ``state_dict``: the entries
    of the base model's state dict instead (persistent buffers too), for a save."""
    from peft.tuners.lora import LoraLayer

    adapter = peft_model.active_adapter
    base = peft_model.get_base_model()
    layers = {
        f"{name}.base_layer.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and adapter in module.active_adapters
    }
    out = []
    if state_dict:
        # Parameters and persistent buffers only: bitsandbytes adds each 4-bit weight's
        # quantization state (absmax, quant_map ...) as entries of its own.
        real = {n for n, _ in base.named_parameters(remove_duplicate=False)}
        real |= {n for n, _ in base.named_buffers(remove_duplicate=False)}
        named = [(n, t) for n, t in base.state_dict(keep_vars=True).items() if n in real]
    else:
        named = list(base.named_parameters(remove_duplicate=False))
    for name, p in named:
        if ".lora_" in name or ".original_module." in name:
            continue
        plain = name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        if ".modules_to_save." in plain:
            continue  # another adapter's copy
        layer = layers.get(name)
        if layer is not None and layer.use_dora.get(adapter, False):
            raise ValueError(f"{plain}: DoRA adapters cannot be merged here (rayless builds plain LoRA)")
        out.append((plain, p, layer))
    tied = {id(p) for _, p, layer in out if layer is not None}
    if sum(id(p) in tied for _, p, _ in out) > len(tied):
        names = sorted(n for n, p, _ in out if id(p) in tied)
        raise ValueError(f"LoRA on a tied weight ({', '.join(names)}): leave it out of --target_modules")
    return out


def merged_weight(weight: torch.Tensor, layer: Any, adapter: str) -> torch.Tensor:
    """``weight + scaling * B @ A`` of ``layer``'s ``adapter``, fp32, a new tensor on the weight's device."""
    from peft.tuners.lora import Linear

    with torch.no_grad():
        if isinstance(layer, Linear):
            a = layer.lora_A[adapter].weight.float()
            b = layer.lora_B[adapter].weight.float()
            delta = (b @ a) * layer.scaling[adapter]
            if layer.fan_in_fan_out:
                delta = delta.T
        else:  # embedding or convolution LoRA: peft's own delta (its math, in its dtype)
            delta = layer.get_delta_weight(adapter).float()
        return dense(weight).float() + delta.to(weight.device)


def dense(p: torch.Tensor) -> torch.Tensor:
    """``p`` detached, or a 4-bit weight (bitsandbytes' ``Params4bit``, QLoRA's frozen base)
    dequantized: the matrix its layer multiplies by, in ``plain_dtype(p)``."""
    state = getattr(p, "quant_state", None)
    if state is None:
        return p.detach()
    import bitsandbytes.functional as bnb

    return bnb.dequantize_4bit(p.data, state)


def plain_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of ``dense(p)``: a 4-bit weight's is the one it was quantized from, not its packed storage."""
    state = getattr(p, "quant_state", None)
    return p.dtype if state is None else state.dtype


def plain_shape(p: Any, *, zero3: bool = False) -> tuple[int, ...]:
    """The shape of ``dense(p)``, read without a gather: a 4-bit weight's unpacked shape, a ZeRO-3
    partitioned parameter's whole one (``ds_shape``)."""
    state = getattr(p, "quant_state", None)
    if state is not None:
        return tuple(state.shape)
    return tuple(p.ds_shape if zero3 else p.shape)
