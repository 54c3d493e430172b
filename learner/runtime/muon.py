"""Muon (``--optim muon``): DeepSpeed's ``MuonWithAuxAdam`` trains the model's 2-D hidden weights
with Muon (``--muon.lr``, ``--muon.momentum``) and everything else with AdamW (the ``--adam.*``
flags), in one optimizer; ``learner.runtime.engine.make_optimizer`` builds it when asked.

Muon (K. Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks") keeps a
momentum ``M <- beta M + (1 - beta) G`` per weight matrix and steps along its orthogonalised form:
``W <- W (1 - lr wd) - lr ortho(G + beta (M - G))`` (Nesterov), where ``ortho(X) ~ U V^T`` for
the SVD ``X = U S V^T``, computed by 5 Newton-Schulz iterations and scaled by
``sqrt(max(1, rows / cols))``. Every singular value of a step is thus about ``lr`` (the
iteration lands them in a band around 1, not exactly on it), whatever the gradient's scale.

Which weights are Muon's (``uses_muon``): a weight whose layer shape is 2-D (a ZeRO-3 shard's
``ds_shape``, since a partitioned parameter reports itself 1-D) with both sides above 1,
outside the embeddings and the output head. AdamW takes the embeddings (DeepSpeed's rule: a
name holding ``embed``, and any ``nn.Embedding``), the LM head (``lm_head``, or whatever the
model's ``get_output_embeddings`` returns), a reward model's or a critic's scalar head (a
``1 x hidden`` matrix: Muon would only normalise it), norms and biases. LoRA's A and B factors
are matrices and go to Muon.

Differences from OpenRLHF 0.10, which names ``Muon`` in DeepSpeed's config and lets
``deepspeed.initialize`` build it: rayless builds the same class itself and hands it to
DeepSpeed as the client optimizer, as it does AdamW. DeepSpeed's own rule (``ndim >= 2`` and no
``embed``/``lm_head`` in the name) would give the RM's ``score`` head and OpenRLHF's
``value_head`` to Muon, which OpenRLHF notes as a known gap; here they go to AdamW. The
auxiliary AdamW is torch's (fused) or DeepSpeedCPUAdam with ``--ds.adam_offload``, as in the Adam
path, instead of DeepSpeed's FusedAdam, which on a CPU host is a JIT-compiled op (a minute on 2
cores). Weight decay spares norms and biases (OpenRLHF 0.10 decays them too under Muon, with
a warning). What DeepSpeed does with the optimizer is the same either way: ZeRO-1/2/3 and the
bf16 optimizer recognise ``MuonWithAuxAdam`` and the ``use_muon`` mark on each parameter.

What DeepSpeed 0.19 fixes and rayless passes on: 5 Newton-Schulz steps and Nesterov momentum
always (``--muon.ns_steps`` / ``--muon.nesterov`` are accepted and said inert), and under a
ZeRO optimizer the clipping norm (``--max_norm``) is taken over Muon's orthogonalised update,
not the gradient, so a clip meant for gradients shrinks every Muon step (``clip_notice``).
ZeRO-3 needs ``reduce_scatter`` off (``learner.runtime.deepspeed_config``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable
from typing import Any

import torch

log = logging.getLogger("rayless.muon")

__all__ = ["layer_shape", "uses_muon", "muon_split", "make_muon_optimizer", "muon_update_norm", "clip_notice"]

# DeepSpeed's own test for embeddings and the LM head (deepspeed.set_optimizer_flags).
_DS_ADAM_NAMES = ("embed", "lm_head")


def layer_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape as a layer: under ZeRO-3 a partition is flat and ``ds_shape`` holds it."""
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(p.shape) if ds_shape is None else tuple(ds_shape)


def _adam_heads(model: torch.nn.Module) -> set[int]:
    """ids of the parameters of every embedding and every output head inside ``model`` (through
    wrappers such as peft's or the reward model's)."""
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            ids.update(id(p) for p in module.parameters())
        get_output = getattr(module, "get_output_embeddings", None)
        if callable(get_output):
            try:
                head = get_output()
            except (AttributeError, NotImplementedError):  # a wrapper that forwards to nothing
                head = None
            if isinstance(head, torch.nn.Module):
                ids.update(id(p) for p in head.parameters())
    return ids


def uses_muon(name: str, p: torch.Tensor, adam_heads: Collection[int] = frozenset()) -> bool:
    """Whether Muon trains this parameter (the module docstring's rule); ``adam_heads``: ids of the
    embedding and output-head parameters (``_adam_heads``)."""
    shape = layer_shape(p)
    if len(shape) != 2 or min(shape) < 2:
        return False  # norms, biases; a 1 x hidden scalar head
    return id(p) not in adam_heads and not any(k in name.lower() for k in _DS_ADAM_NAMES)


def muon_split(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(names Muon trains, names AdamW trains) among ``model``'s trainable parameters."""
    heads = _adam_heads(model)
    muon: list[str] = []
    adam: list[str] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if uses_muon(name, p, heads) else adam).append(name)
    return muon, adam


def make_muon_optimizer(
    model: torch.nn.Module,
    *,
    muon_lr: float,
    momentum: float,
    adam_lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    no_decay: tuple[str, ...],
    adam_offload: bool,
    fused: bool,
) -> torch.optim.Optimizer:
    """DeepSpeed's ``MuonWithAuxAdam`` over ``model``'s trainable parameters, split by
    ``muon_split``; names ending in ``no_decay`` get no weight decay. Each parameter is marked
    ``use_muon`` (True/False), the mark DeepSpeed's ZeRO and bf16 optimizers read. The AdamW half
    is DeepSpeedCPUAdam with ``adam_offload``, else torch's AdamW (``fused`` as the Adam path)."""
    # Imported here: this module compiles Muon's Newton-Schulz kernels (torch.compile) on first use.
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    heads = _adam_heads(model)
    halves: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        muon = uses_muon(name, p, heads)
        p.use_muon = muon
        halves.setdefault((muon, not name.endswith(no_decay)), []).append(p)
    groups: list[dict[str, Any]] = []
    # Muon's groups first, as DeepSpeed orders them: the LR a trainer logs (group 0's) is Muon's.
    for (muon, decay), params in sorted(halves.items(), key=lambda kv: (not kv[0][0], not kv[0][1])):
        wd = weight_decay if decay else 0.0
        if muon:
            # Each group is all-Muon or all-Adam: ZeRO-1/2 flatten a group into one partition
            # and decide Muon or not by its first tensor.
            groups.append(dict(params=params, use_muon=True, lr=muon_lr, momentum=momentum, weight_decay=wd))
        else:
            groups.append(dict(params=params, use_muon=False, lr=adam_lr, betas=betas, eps=eps, weight_decay=wd))
    if adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        adam_cls: type[torch.optim.Optimizer] = DeepSpeedCPUAdam
        adam_kwargs: dict[str, Any] = {"adamw_mode": True}
    else:
        adam_cls, adam_kwargs = torch.optim.AdamW, {"fused": fused}
    return MuonWithAuxAdam(groups, adam_optimizer=adam_cls, adam_optimizer_kwargs=adam_kwargs, adam_w_mode=True)


def muon_update_norm(params: Iterable[torch.Tensor]) -> float:
    """About the largest Frobenius norm of one Muon update of these matrices: a full-rank one has
    ``min(rows, cols)`` singular values near 1, scaled by ``sqrt(max(1, rows / cols))``, so its
    squared norm is about ``rows``; a gradient of rank r gives about r singular values."""
    return math.sqrt(sum(layer_shape(p)[0] for p in params if getattr(p, "use_muon", False)))


def clip_notice(engine: Any, grad_clip: float) -> str:
    """What ``--max_norm`` does to Muon under this engine's optimizer, when it is not what a user
    expects; empty otherwise. DeepSpeed's ZeRO-1/2/3 optimizers write Muon's update into the
    gradient partitions before they take the clipping norm, so the norm is the update's (up to
    ``muon_update_norm``, reached by full-rank gradients), and a clip below it scales every Muon
    step down. Its stage-0 path and its bf16 optimizer (ZeRO-0/1 in bf16) clip the gradient, as
    for AdamW."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if grad_clip <= 0 or not isinstance(engine.optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        return ""
    norm = muon_update_norm(p for p in engine.module.parameters())
    if grad_clip >= norm:
        return ""
    return (
        f"--max_norm {grad_clip:g} with --optim muon at ZeRO-{engine.zero_optimization_stage()}: "
        f"DeepSpeed takes the clipping norm over Muon's orthogonalised update, not the gradient; that norm "
        f"is up to about {norm:.0f} for this model (less while gradients have low rank), so the clip shrinks "
        f"each Muon step, to as little as {grad_clip / norm:.2g} of its size; --max_norm 0 turns clipping off "
        f"(OpenRLHF's advice for Muon)"
    )
