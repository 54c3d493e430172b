"""The weights a learner pushes: a module's parameters by checkpoint name, in the engine dtype.

``ModelWeights`` is the source ``common.weights.publisher.WeightPublisher`` iterates once per
push; ``AdapterWeights`` the LoRA adapter alone (``--lora_sync adapter``); ``unwrap`` finds the trained module inside DeepSpeed's (or DDP's) wrapper, for the
publisher and for the learner's saves alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from common.weights.lora import dense, is_peft, merged_weight, plain_dtype, plain_parameters, plain_shape
from common.weights.wire import ParamMeta


def unwrap(model: Any) -> torch.nn.Module:
    """The trained module whose parameter names are the checkpoint's.

    A DeepSpeed engine or DDP wraps it as ``.module`` (names must not carry the wrapper's
    "module." prefix); a module that adds a forward of its own around an HF model (the reward and
    value models in ``learner.runtime.models``) exposes the HF model as ``hf_model``, which is what
    is saved and served. A bare HF model has neither.
    """
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    inner = getattr(model, "hf_model", None)
    return inner if isinstance(inner, torch.nn.Module) else model


class _Listed:
    """What a source tells the servers before sending: ``_params`` (name, parameter) in the
    order sent, each in ``dtype`` (None: its own), shapes from ``ds_shape`` under ZeRO-3 (no
    gather)."""

    _params: list[tuple[str, Any]]
    dtype: torch.dtype | None
    zero3: bool

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, self.dtype or plain_dtype(p), plain_shape(p, zero3=self.zero3)) for n, p in self._params]

    def nbytes(self) -> int:
        return sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in self.metadata())


class ModelWeights(_Listed):
    """A vLLM ``WeightSource`` over a torch module: checkpoint (HF) names, in the engine dtype.

    - Tied parameters: the engine must load them under every name (``lm_head.weight`` and
      ``model.embed_tokens.weight``; vLLM's reload leaves a tied ``lm_head`` stale otherwise).
      By default each name is listed and sent; with ``tied_once`` the tensor is listed (and
      sent) once, under its first name, and ``aliases`` maps the other names to it for a
      receiver that loads it under each (``WeightUpdate.aliases``).
    - Under ZeRO-3 (parameters carry ``ds_id``), each layer's parameters are gathered on all
      ranks together; rank 0 copies them out while gathered (``keep=True``), other ranks only
      take part in the gather (``keep=False``).
    - Shapes come from ``ds_shape`` under ZeRO-3, so ``metadata()`` never gathers.
    - A LoRA (peft) model is listed under its base model's names, and each adapted weight is
      sent as ``W + (alpha / r) * B @ A``, computed in fp32 when it is sent (one tensor at a
      time, out of place) and cast to the engine dtype (``common.weights.lora``). Under ZeRO-3
      the adapter's tensors join their layer's gather, so the merge sees them whole. With
      ``merge=False`` the base weights go as they are (``--lora_sync adapter``: the servers
      serve the adapter, ``AdapterWeights``, beside them).

    It keeps ``vllm.distributed.weight_transfer.base.WeightSource``'s contract (metadata and
    iteration agree element for element) without importing vLLM: a learner that only sends
    weights does not load vLLM.
    """

    lora = None  # a WeightUpdate of these tensors loads them (AdapterWeights: serves them)

    def __init__(
        self,
        model: Any,
        dtype: torch.dtype | None = None,
        keep: bool = True,
        tied_once: bool = False,
        merge: bool = True,
    ) -> None:
        self.module = unwrap(model)
        self.dtype = dtype
        self.keep = keep
        # A LoRA (peft) model is pushed as its base model with the adapter merged, computed per
        # tensor as it is sent (common.weights.lora): the engines see no LoRA at all.
        self._merge: dict[str, Any] = {}  # listed name -> the LoRA layer adapting it
        if is_peft(self.module):
            self._adapter = self.module.active_adapter
            entries = plain_parameters(self.module)
            self._params = [(n, p) for n, p, _ in entries]
            self._merge = {n: layer for n, _, layer in entries if layer is not None and merge}
        else:
            self._params = list(self.module.named_parameters(remove_duplicate=False))
        self.aliases: dict[str, str] = {}  # name -> the listed name of the same parameter
        if tied_once:
            first: dict[int, str] = {}
            for name, p in self._params:
                if first.setdefault(id(p), name) != name:
                    self.aliases[name] = first[id(p)]
            self._params = [(n, p) for n, p in self._params if n not in self.aliases]
        self.zero3 = any(hasattr(p, "ds_id") for _, p in self._params)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        if not self.zero3:
            for name, p in self._params:
                layer = self._merge.get(name)
                t = dense(p) if layer is None else merged_weight(p, layer, self._adapter)
                yield name, t.to(self.dtype or plain_dtype(p))
            return
        import deepspeed

        for group in _layer_runs(self._params):
            unique = {id(p): p for _, p in group}
            for name, _ in group:  # a merged weight needs its adapter whole too
                if (layer := self._merge.get(name)) is not None:
                    unique.update((id(q), q) for q in layer.parameters())
            # A collective: every rank gathers the same layer at the same time.
            with deepspeed.zero.GatheredParameters(list(unique.values()), modifier_rank=None):
                for name, p in group:
                    if not self.keep:
                        yield name, None
                        continue
                    layer = self._merge.get(name)
                    # Copy out while gathered: the bucket is packed after the context exits.
                    t = dense(p) if layer is None else merged_weight(p, layer, self._adapter)
                    yield name, t.to(self.dtype or plain_dtype(p), copy=layer is None)  # a merge is a new tensor


def _layer_runs(params: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    """Consecutive parameters of one layer (same prefix up to the first numeric segment, e.g.
    ``model.layers.3``): the unit gathered at once under ZeRO-3, so peak memory is one layer,
    not the model. Order is kept: it is the order the servers were told."""

    def key(name: str) -> str:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[: i + 1])
        return name  # embeddings, final norm, lm_head: one each

    runs: list[list[tuple[str, Any]]] = []
    last = None
    for name, p in params:
        k = key(name)
        if not runs or k != last:
            runs.append([])
            last = k
        runs[-1].append((name, p))
    return runs


def checked(pairs: Iterable[tuple[str, torch.Tensor]], meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Iteration checked against the metadata the servers were told to expect: a mismatch would
    cut buckets differently on the two sides, so it is an error naming the first bad tensor."""
    i = -1
    for i, (name, t) in enumerate(pairs):
        m = meta[i] if i < len(meta) else None
        if m is None or name != m.name or t.dtype != m.dtype or tuple(t.shape) != tuple(m.shape):
            want = f"{m.name} {m.dtype} {tuple(m.shape)}" if m else "nothing more"
            raise ValueError(
                f"weights changed while sending: tensor {i} is {name} {t.dtype} {tuple(t.shape)}, servers expect {want}"
            )
        yield name, t
    if i + 1 != len(meta):
        raise ValueError(f"weights changed while sending: {i + 1} tensors, servers expect {len(meta)}")


class AdapterWeights(_Listed):
    """The active LoRA adapter of a peft model, as a server serves it (``--lora_sync adapter``):
    each adapted layer's ``lora_A`` and ``lora_B`` weights under PEFT's saved names
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), in the engine dtype,
    and ``lora`` (rank, alpha, target modules: the rest of its ``adapter_config.json``). The
    same contract as ``ModelWeights`` (metadata and iteration agree; under ZeRO-3 each tensor is
    gathered on every rank, rank 0 keeps it). Plain LoRA on linear layers only: the form vLLM
    serves; DoRA, rsLoRA, embedding adapters and ``modules_to_save`` are refused here, naming them."""

    aliases: dict[str, str] = {}

    def __init__(self, model: Any, dtype: torch.dtype | None = None, keep: bool = True) -> None:
        from peft.tuners.lora import Linear

        from common.protocol import LoraAdapter

        self.module = unwrap(model)
        if not is_peft(self.module):
            raise ValueError("--lora_sync adapter: the model has no LoRA adapter (--lora_rank 0)")
        self.dtype, self.keep = dtype, keep
        adapter = self.module.active_adapter
        config = self.module.peft_config[adapter]
        refused = [f for f in ("use_dora", "use_rslora") if getattr(config, f, False)]
        if getattr(config, "modules_to_save", None):
            refused.append(f"modules_to_save {config.modules_to_save}")
        self._params: list[tuple[str, Any]] = []
        targets: set[str] = set()
        for module_name, module in self.module.named_modules():
            if not hasattr(module, "lora_A") or adapter not in getattr(module, "lora_A", {}):
                if adapter in getattr(module, "lora_embedding_A", {}):
                    refused.append(f"an embedding adapter ({module_name})")
                continue
            if not isinstance(module, Linear):
                refused.append(f"an adapter on {type(module).__name__} {module_name}")
                continue
            targets.add(module_name.rsplit(".", 1)[-1])
            for part in ("lora_A", "lora_B"):
                self._params.append((f"{module_name}.{part}.weight", getattr(module, part)[adapter].weight))
        if refused:
            raise ValueError(
                f"--lora_sync adapter serves plain LoRA on linear layers; this model has {', '.join(refused)}"
            )
        self.lora = LoraAdapter(rank=int(config.r), alpha=float(config.lora_alpha), target_modules=sorted(targets))
        self.zero3 = any(hasattr(p, "ds_id") for _, p in self._params)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        if not self.zero3:
            for name, p in self._params:
                yield name, p.detach().to(self.dtype or p.dtype)
            return
        import deepspeed

        for name, p in self._params:  # a collective per tensor: every rank, in this order
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield name, (p.data.to(self.dtype or p.dtype, copy=True) if self.keep else None)
