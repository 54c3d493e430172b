"""Model pieces the trainers share: the reward model (a scalar head on a causal LM), summed
response log-probabilities, and the check that a model can train on packed rows.

The reward model IS a transformers ``*ForSequenceClassification`` with ``num_labels=1``
(``Qwen2ForSequenceClassification`` for the tiny model), so what the RM trainer saves loads
with ``AutoModelForSequenceClassification`` and in our reward service, which reads the
``score`` head at the last attention-mask token. ``RewardModel`` wraps it with exactly that
forward: transformers' own classifier forward finds the last token by searching for the
pad id instead, which a model whose pad = EOS gets wrong.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.distributed as dist

from common.tiled_logits import head_inputs, token_logprobs, untileable_reason
from common.weights.source import unwrap
from learner.algorithms.kl import last_token_index
from learner.algorithms.losses import log_probs_from_logits
from learner.algorithms.sft_loss import IGNORE_INDEX
from learner.runtime.engine import load_pretrained
from learner.runtime.lora import base_hf_model

log = logging.getLogger(__name__)


class ScalarHeadModel(torch.nn.Module):
    """A transformers ``*ForSequenceClassification`` (``num_labels=1``) used through its backbone
    and its linear head, at positions the subclass picks. ``hf_model`` is what is saved."""

    def __init__(self, hf_model: torch.nn.Module, head_name: str = "score") -> None:
        super().__init__()
        self.hf_model = hf_model
        self.head_name = head_name

    @property
    def config(self):
        return self.hf_model.config

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        hf = base_hf_model(self.hf_model)  # under LoRA the peft model's HF model, adapters inside
        backbone = getattr(hf, hf.base_model_prefix)
        return backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (B, T, H)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (...) scalars, in fp32."""
        return getattr(base_hf_model(self.hf_model), self.head_name)(hidden).squeeze(-1).float()


class RewardModel(ScalarHeadModel):
    """``forward(input_ids, attention_mask) -> (B,)`` rewards, read at the last attended token."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Positions follow the mask, as in the reward service, so left padding changes nothing.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.hidden_states(input_ids, attention_mask, position_ids)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_token_index(attention_mask)]
        return self.head(last)  # (B,)


def head_prefix(config: Any, value_head_prefix: str = "score") -> str:
    """The name of a checkpoint's scalar head: the one its config records (``value_head_prefix``,
    which our RM trainer and OpenRLHF write), else ``--ds.value_head_prefix``; OpenRLHF's rule."""
    recorded = getattr(config, "value_head_prefix", None)
    return recorded if isinstance(recorded, str) and recorded else value_head_prefix


def load_reward_model(
    path: str, *, tokenizer: Any = None, value_head_prefix: str = "score", **load_kwargs: Any
) -> RewardModel:
    """A reward model from a saved reward model (head kept) or a causal LM (new head).

    The head is the checkpoint's ``<prefix>.weight`` (and ``.bias``), ``prefix`` from
    ``head_prefix`` (``--ds.value_head_prefix``, default ``score``: transformers' sequence
    classifiers; OpenRLHF's older ``value_head``, or any name). It loads into the classifier's own
    ``score`` module, renamed on the way in (transformers' ``key_mapping``) and so back to
    ``prefix`` when saved, which the config records (``value_head_prefix``). A checkpoint without that tensor gets a new head, N(0, 1/(H+1)) as in
    OpenRLHF, small so first rewards are near 0. ``load_kwargs`` go to
    ``learner.runtime.engine.load_pretrained`` (zero_stage, bf16, ...).
    """
    import re

    import deepspeed
    from transformers import AutoConfig, AutoModelForSequenceClassification

    source = AutoConfig.from_pretrained(path)
    prefix = head_prefix(source, value_head_prefix)
    pad_id = source.pad_token_id
    if pad_id is None and tokenizer is not None:
        pad_id = tokenizer.pad_token_id
    renamed: dict[str, Any] = {} if prefix == "score" else {"key_mapping": {rf"^{re.escape(prefix)}\.": "score."}}
    hf, info = load_pretrained(
        path,
        auto_class=AutoModelForSequenceClassification,
        num_labels=1,
        pad_token_id=pad_id,
        output_loading_info=True,
        **renamed,
        **load_kwargs,
    )
    has_head = not any(k.startswith("score.") for k in info.get("missing_keys", ()))
    # Saved with the model: the name its head is written under (the renaming runs backwards on
    # save), for a reward service, OpenRLHF or this function to find it by.
    hf.config.value_head_prefix = prefix
    log.info("%s: value head %s", path, f"{prefix!r} loaded" if has_head else f"new (no {prefix}.weight in it)")
    model = RewardModel(hf)
    if not has_head:
        head = getattr(hf, model.head_name)
        with deepspeed.zero.GatheredParameters(
            list(head.parameters()), modifier_rank=0, enabled=hasattr(head.weight, "ds_id")
        ):
            gen = torch.Generator().manual_seed(0)  # the same head on every rank
            head.weight.data.copy_(torch.randn(head.weight.shape, generator=gen) / (hf.config.hidden_size + 1))
            if getattr(head, "bias", None) is not None:
                head.bias.data.zero_()
    return model


def tileable(hf_model: Any) -> bool:
    """Whether ``common.tiled_logits`` reproduces this HF model's logits (``--ds.logits_tile_tokens``);
    the reason it does not, if so, is said once per model class, and the caller builds them whole."""
    reason = untileable_reason(hf_model)
    if reason is not None and type(hf_model) not in _SAID_UNTILEABLE:
        _SAID_UNTILEABLE.add(type(hf_model))
        log.warning("--ds.logits_tile_tokens: %s's logits are built whole: %s", type(hf_model).__name__, reason)
    return reason is None


_SAID_UNTILEABLE: set[type] = set()


def label_logprobs(engine: Any, batch: dict, *, tile_tokens: int, packed: bool | None = None) -> torch.Tensor:
    """(B, T) float32 log-probs of ``batch["labels"]`` (shifted targets) under the model, 0 where
    a label is ``IGNORE_INDEX``.

    ``tile_tokens`` > 0 (``--ds.logits_tile_tokens``): only the counted positions' hidden states go
    through the head, that many at a time (``common.tiled_logits``): the (B, T, V) logits are never
    built, nor the prompt's. 0: the model's whole logits, then ``log_probs_from_logits``.
    """
    labels = batch["labels"]
    mask = labels != IGNORE_INDEX  # (B, T)
    packed = packed if packed is not None else "position_ids" in batch
    inputs = (
        dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        if packed
        else dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    )
    hf = base_hf_model(unwrap(engine))
    if tile_tokens <= 0 or not tileable(hf):
        logits = engine(**inputs, use_cache=False).logits  # (B, T, V)
        return log_probs_from_logits(logits, labels.masked_fill(~mask, 0)) * mask
    head = hf.get_output_embeddings()
    hidden = head_inputs(engine, head, **inputs, use_cache=False, logits_to_keep=0)  # (B, T, H): every column
    lp, _ = token_logprobs(head, hidden[mask], labels[mask], tile_tokens=tile_tokens)  # (K,)
    return lp.new_zeros(mask.shape).masked_scatter(mask, lp)


def sequence_logprobs(
    engine: Any, batch: dict, *, tile_tokens: int, packed: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the counted tokens per row (``label_logprobs``), and their count.

    Returns:
        ``(logp_sum (B,), tokens (B,))``, float32.
    """
    logp = label_logprobs(engine, batch, tile_tokens=tile_tokens, packed=packed)  # (B, T), 0 where not counted
    return logp.sum(-1), (batch["labels"] != IGNORE_INDEX).sum(-1).float()


# Attention implementations whose transformers code keeps packed samples apart given position
# ids that restart per sample and no attention mask: sdpa and eager through masking_utils'
# block-diagonal mask (checked on CPU by tests/unit/rl/test_packing.py), flash-attention through
# per-sample cu_seqlens derived from the same position ids (one row per forward, as here).
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# The masking_utils builders that find sample boundaries in position ids.
_PACKED_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


def check_packable(model: Any, role: str) -> None:
    """Refuse ``--packing_samples`` for a model whose attention would cross packed samples.

    ``model``: the engine or module (unwrapped to the HF model). Raises ValueError naming why.
    """
    hf = base_hf_model(unwrap(model))  # a LoRA model: the HF model peft wraps
    config = getattr(hf, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in PACKABLE_ATTENTION:
        raise ValueError(
            f"--packing_samples: the {role} model uses attention implementation {impl!r}; packed rows need "
            f"one that keeps samples apart by their position ids ({', '.join(PACKABLE_ATTENTION)})"
        )
    code = sys.modules.get(type(hf).__module__)
    if not any(hasattr(code, name) for name in _PACKED_MASK_BUILDERS):
        raise ValueError(
            f"--packing_samples: the {role} model's code ({type(hf).__module__}) does not build its attention "
            "mask with transformers.masking_utils, which is what keeps packed samples apart; its attention "
            "would cross samples"
        )
    on_gpu = any(p.device.type == "cuda" for p in hf.parameters())
    if on_gpu and impl in ("sdpa", "eager") and (not dist.is_initialized() or dist.get_rank() == 0):
        # The block-diagonal mask is dense: SDPA/eager compute all L x L scores of the row and
        # zero most of them, (sum of lengths)^2 instead of the sum of squares a varlen kernel does.
        log.warning(
            "--packing_samples with %s attention: the %s's packed rows compute a dense (L x L) masked "
            "attention; --flash_attn (flash_attention_2) computes only each sample's own block",
            impl,
            role,
        )
