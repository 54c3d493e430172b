"""LoRA for every trainer (``--ds.lora.rank`` / ``--lora_rank`` and its siblings: ``learner.runtime.flags.LoraSection``):
SFT, RM and DPO, and train_ppo, which pushes merged weights or the adapter (``--lora_sync``).

``apply_lora`` wraps the loaded model with a peft ``LoraConfig`` before DeepSpeed sees it: the
base weights are frozen, so only the adapter (and, for a reward model, its ``score`` head, kept
trainable through peft's ``modules_to_save``) reaches the optimizer and DeepSpeed's optimizer
state. Checkpoints need nothing of their own: the engine's module state holds the adapter and
the optimizer state is the adapter's.

``save_hf`` (``learner.runtime.engine``) writes a LoRA model as a plain HF model, the adapter
merged out of place (``merged_state_dict``: the trained weights are not touched, so a save
in the middle of a run changes nothing), and the adapter alone in ``<path>/adapter/`` with
peft's ``save_pretrained``. A QLoRA base (``--ds.load_in_4bit``) is saved the same way, each base
weight dequantized (``common.weights.lora.dense``): the plain model holds no 4-bit weights.

Under ZeRO-3 the base model is built partitioned (``zero.Init``) and peft's adapters are
partitioned by DeepSpeed at the engine's start like any other parameter; a save gathers each
adapted weight with its adapter on every rank (a collective), and rank 0 writes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from common.weights.lora import dense, is_peft, merged_weight, plain_dtype, plain_parameters

log = logging.getLogger("rayless.lora")

ADAPTER_DIR = "adapter"


def lora_config(lora: Any, *, modules_to_save: list[str] | None = None):
    """peft's LoraConfig of a ``ds.lora`` section (``learner.runtime.flags.LoraSection``)."""
    from peft import LoraConfig

    targets = lora.target_modules
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        # "all-linear": every linear layer but the output head (peft's own choice)
        target_modules=targets[0] if targets == ["all-linear"] else list(targets),
        modules_to_save=modules_to_save,
        bias="none",
    )


def _wrap(hf_model: torch.nn.Module, config: Any, lora: Any, gradient_checkpointing: bool) -> torch.nn.Module:
    from peft import get_peft_model

    try:
        model = get_peft_model(hf_model, config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model ..."
        raise ValueError(f"--ds.lora.target_modules {' '.join(lora.target_modules)}: {e}") from None
    if gradient_checkpointing:
        # Checkpointed blocks of a frozen base need an input that requires grad, or no
        # gradient reaches the adapters inside them.
        model.enable_input_require_grads()
    return model


def apply_lora(model: torch.nn.Module, lora: Any, *, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """``model`` (a causal LM, or a ``learner.runtime.models.ScalarHeadModel``) with LoRA
    adapters per ``lora`` (the ``ds.lora`` section: rank > 0; else returned as is). A
    scalar-head model keeps its class: its ``hf_model`` becomes the peft model, the head
    trained in full. ``gradient_checkpointing``: the model checkpoints its blocks."""
    if lora.rank <= 0:
        return model
    inner = getattr(model, "hf_model", None)
    if isinstance(inner, torch.nn.Module):
        head = model.head_name
        model.hf_model = _wrap(inner, lora_config(lora, modules_to_save=[head]), lora, gradient_checkpointing)
        wrapped = model.hf_model
    else:
        model = wrapped = _wrap(model, lora_config(lora), lora, gradient_checkpointing)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    log.info(
        "LoRA rank %d alpha %d on %s: %d of %d parameters train (%.2f%%)",
        lora.rank,
        lora.alpha,
        lora.target_modules,
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )
    return model


def is_lora(module: Any) -> bool:
    return is_peft(module)


def base_hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a peft model (its LoRA layers injected in place); ``module`` itself otherwise."""
    return module.get_base_model() if is_lora(module) else module


def _gathered(params: list[Any]):
    """A context in which ZeRO-3 ``params`` are whole on every rank (a collective: every rank
    enters it for the same tensors in the same order); nothing to do for others. Each tensor
    once, though listed twice (a layer's parameters include the base weight)."""
    import contextlib

    partitioned = list({id(q): q for q in params if hasattr(q, "ds_id")}.values())
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def merged_state_dict(peft_model: Any, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The plain HF state dict of ``peft_model`` with its active adapter merged, on CPU, out of
    place: ``W + scale * B @ A`` per adapted layer (fp32 math, stored in the weight's dtype), the
    trained copy of each ``modules_to_save`` module; LoRA's own tensors left out. Tied parameters
    stay one tensor under both names. Under ZeRO-3, call on every rank (each weight is gathered
    with its adapter); ranks with ``keep=False`` take part and get an empty dict."""
    adapter = peft_model.active_adapter
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for name, p, layer in plain_parameters(peft_model, state_dict=True):
        key = id(p)
        if key in copies:  # a tied weight: already gathered and copied under its first name
            if keep:
                out[name] = copies[key]
            continue
        with _gathered([p, *(layer.parameters() if layer is not None else ())]):
            if keep:
                t = merged_weight(p, layer, adapter).to(plain_dtype(p)) if layer is not None else dense(p)
                copies[key] = t.to("cpu", copy=layer is None)
                out[name] = copies[key]
            else:
                copies[key] = torch.empty(0)
    return out


def adapter_state_dict(peft_model: Any, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The trained tensors (adapters, ``modules_to_save`` copies) under the peft model's own
    names, whole and on CPU (gathered one at a time under ZeRO-3: call on every rank; ranks with
    ``keep=False`` take part and get an empty dict). What ``save_pretrained`` filters the adapter from."""
    out: dict[str, torch.Tensor] = {}
    for name, q in peft_model.named_parameters():
        if not q.requires_grad:
            continue
        with _gathered([q]):
            if keep:
                out[name] = q.detach().to("cpu", copy=True)
    return out


def save_lora_hf(
    peft_model: Any,
    tokenizer: Any,
    path: str | os.PathLike,
    config_updates: dict[str, Any] | None = None,
    *,
    rank0: bool = True,
) -> None:
    """The merged plain HF model in ``path`` and the adapter in ``path/adapter``, written by rank 0.
    Under ZeRO-3 every rank calls it (the gathers are collectives) with ``rank0`` set on one."""
    merged = merged_state_dict(peft_model, keep=rank0)
    trained = adapter_state_dict(peft_model, keep=rank0)
    if not rank0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = peft_model.get_base_model()
    for key, value in (config_updates or {}).items():
        setattr(base.config, key, value)
    saver = base if getattr(base.config, "quantization_config", None) is None else _dense_twin(base)
    saver.save_pretrained(path, state_dict=merged, safe_serialization=True)
    peft_model.save_pretrained(path / ADAPTER_DIR, state_dict=trained, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def _dense_twin(model: Any) -> Any:
    """An empty (meta-device) model of ``model``'s class and config, less its quantization: what
    saves a QLoRA base (``--ds.load_in_4bit``) merged and dense (``common.weights.lora.dense``).
    transformers saves a quantized model's own packed state whatever state dict it is handed, and
    a config naming the 4-bit quantization would have ``from_pretrained`` read dense weights as packed."""
    import copy

    config = copy.deepcopy(model.config)
    del config.quantization_config
    with torch.device("meta"):
        twin = type(model)(config)
    twin.generation_config = model.generation_config
    return twin
