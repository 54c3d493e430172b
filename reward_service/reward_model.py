"""Reward-model scorer: a scalar head read at the last non-pad token of prompt + response.

Two checkpoint formats load the same way:

- Hugging Face ``AutoModelForSequenceClassification`` (``Qwen2ForSequenceClassification``,
  ``LlamaForSequenceClassification``, ...): backbone under ``model.*``, head ``score.weight``
  of shape ``(1, hidden)``;
- OpenRLHF's reward model: the same backbone with a head named ``value_head`` (older
  releases) or ``score``, config keys ``mean`` / ``std`` for normalisation.

So this module loads the backbone with ``AutoModel`` and the head's tensor(s) straight from
the checkpoint files, and computes ``reward = head(hidden[last non-pad token])`` itself. The
last token is found from the attention mask this module builds, not by searching for the pad
id (HF's classifier heads do that, and a response that contains the pad id, as the EOS of
models whose pad = eos, fools it). Position ids follow the mask, so left and right padding
give the same rewards.

Normalisation (``--normalize_reward``): ``(r - config.mean) / config.std``, with ``mean`` and
``std`` floats (or 1-element lists, as some OpenRLHF checkpoints have) in the RM's
``config.json``, written by the RM trainer from its training-set rewards.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from reward_service.batching import chunks, last_token_index, pad

log = logging.getLogger(__name__)

HEAD_PREFIXES = ("score", "value_head")  # tried in this order when --value_head_prefix=auto


class RewardModelError(RuntimeError):
    """The reward model checkpoint cannot be used (missing head, bad normalisation keys)."""


def load_head(
    path: str, prefix: str = "auto", config_prefix: str | None = None
) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """Finds the scalar head in a checkpoint dir: ``(prefix, weight (1, H), bias (1,) | None)``.

    ``auto`` tries the prefix the checkpoint's config names (``value_head_prefix``, as our RM
    trainer and OpenRLHF write it), then ``score``, then ``value_head``."""
    if prefix == "auto":
        tried = tuple(dict.fromkeys(([config_prefix] if isinstance(config_prefix, str) else []) + list(HEAD_PREFIXES)))
    else:
        tried = (prefix,)
    tensors = _checkpoint_tensors(path, [f"{p}.{k}" for p in tried for k in ("weight", "bias")])
    for p in tried:
        w = tensors.get(f"{p}.weight")
        if w is None:
            continue
        if w.ndim != 2 or w.shape[0] != 1:
            raise RewardModelError(
                f"{path}: head {p}.weight has shape {tuple(w.shape)}; a reward model needs one output (num_labels=1)"
            )
        return p, w, tensors.get(f"{p}.bias")
    raise RewardModelError(
        f"{path}: no reward head found (looked for {', '.join(t + '.weight' for t in tried)}); "
        "pass --value_head_prefix NAME if the checkpoint names it differently"
    )


def _checkpoint_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors that exist in a safetensors (single or sharded) or .bin checkpoint."""
    wanted = set(names)
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index) or os.path.exists(single):
        from safetensors import safe_open

        if os.path.exists(index):
            weight_map = json.load(open(index))["weight_map"]
            files = {weight_map[n] for n in wanted if n in weight_map}
        else:
            files = {"model.safetensors"}
        out = {}
        for fname in files:
            with safe_open(os.path.join(path, fname), framework="pt") as f:
                for n in wanted & set(f.keys()):
                    out[n] = f.get_tensor(n)
        return out
    binf = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(binf):
        sd = torch.load(binf, map_location="cpu", weights_only=True)
        return {n: sd[n] for n in wanted if n in sd}
    raise RewardModelError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def normalization(config, path: str) -> tuple[float, float]:
    """``(mean, std)`` from the RM config keys ``mean`` / ``std``; raises naming what is missing."""
    vals = []
    for key in ("mean", "std"):
        v = getattr(config, key, None)
        if isinstance(v, (list, tuple)):
            v = v[0] if len(v) == 1 else None
        if not isinstance(v, (int, float)):
            raise RewardModelError(
                f"--normalize_reward: {path}/config.json has no numeric '{key}' "
                f"(got {getattr(config, key, None)!r}); the RM trainer writes 'mean' and 'std'"
            )
        vals.append(float(v))
    if not vals[1] > 0:
        raise RewardModelError(f"--normalize_reward: {path}/config.json has std={vals[1]}, must be > 0")
    return vals[0], vals[1]


class RewardModelScorer:
    def __init__(
        self,
        backbone: torch.nn.Module,
        head: torch.nn.Linear,
        *,
        micro_batch_size: int = 8,
        pad_id: int = 0,
        padding_side: str = "right",
        mean: float = 0.0,
        std: float = 1.0,
        max_tokens: int = 0,
    ) -> None:
        self.backbone = backbone.eval().requires_grad_(False)
        self.head = head.eval().requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens  # > 0: micro-batches by padded tokens (--max_tokens_per_gpu)
        self.pad_id = pad_id
        self.padding_side = padding_side
        self.mean, self.std = mean, std

    @classmethod
    def load(
        cls,
        path: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        attn_implementation: str | None = None,
        micro_batch_size: int = 8,
        value_head_prefix: str = "auto",
        normalize: bool = False,
        padding_side: str = "right",
        max_tokens: int = 0,
    ) -> RewardModelScorer:
        from transformers import AutoConfig, AutoModel
        from transformers.utils import logging as hf_logging

        config = AutoConfig.from_pretrained(path)
        mean, std = normalization(config, path) if normalize else (0.0, 1.0)
        prefix, w, b = load_head(path, value_head_prefix, getattr(config, "value_head_prefix", None))
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the head is "unexpected" to AutoModel: by design
        try:
            backbone = AutoModel.from_pretrained(path, dtype=dtype, **kw).to(device)
        finally:
            hf_logging.set_verbosity(verbosity)
        head = torch.nn.Linear(w.shape[1], 1, bias=b is not None, dtype=dtype, device=device)
        with torch.no_grad():
            head.weight.copy_(w)
            if b is not None:
                head.bias.copy_(b)
        pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        log.info(
            "reward model %s loaded (head %r, %s, %s%s)",
            path,
            prefix,
            dtype,
            device,
            f", normalised with mean={mean} std={std}" if normalize else "",
        )
        return cls(
            backbone,
            head,
            micro_batch_size=micro_batch_size,
            pad_id=int(pad_id),
            padding_side=padding_side,
            mean=mean,
            std=std,
            max_tokens=max_tokens,
        )

    @property
    def device(self) -> torch.device:
        return next(self.backbone.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.backbone.get_input_embeddings().num_embeddings

    @torch.no_grad()
    def rewards(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """One reward per 1-D token sequence (prompt + response): ``(N,)`` float32."""
        for i, s in enumerate(seqs):
            if len(s) == 0:
                raise ValueError(f"sample {i} has no tokens to score")
        out = torch.empty(len(seqs), dtype=torch.float32)
        for chunk in chunks([len(s) for s in seqs], self.micro_batch_size, self.max_tokens):
            ids, mask, pos = pad([seqs[i].long() for i in chunk], self.pad_id, self.padding_side, self.device)
            hidden = self.backbone(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False
            ).last_hidden_state  # (B, T, H)
            last = hidden[torch.arange(len(chunk), device=hidden.device), last_token_index(mask)]  # (B, H)
            r = self.head(last)[:, 0].float().cpu()  # (B,)
            out[chunk] = (r - self.mean) / self.std
        return out
