"""Preference pairs for the reward model and DPO: rows -> token samples -> micro-batches.

A row holds a chosen and a rejected response (text, or chat messages holding the whole
conversation), optionally a prompt (``--prompt_key``) and a margin (``--margin_key``).
Both sequences are rendered as ``prompt + response`` ending in the tokenizer's EOS (see
``common.datasets.render_response``) and tokenized with a response mask.

Truncation to ``--max_len`` keeps the start. For the reward model the last kept token is
then forced to EOS, because the reward is read at the last token and must be read at the
same kind of token as at serving time (a response that stopped on EOS), as OpenRLHF does.
A pair whose prompt alone fills ``max_len`` has no response left to judge and is skipped
(counted).

A micro-batch of B pairs is 2B right-padded rows, the B chosen first, then the B rejected:
one forward pass scores both halves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.datasets import render_response
from learner.supervised.sft_data import MaskedTokens, collate_padded, encode_prompt_response, truncate


@dataclass
class Pair:
    chosen: MaskedTokens
    rejected: MaskedTokens
    margin: float = 0.0


def _encode(
    tokenizer: Any,
    prompt_value: Any,
    response_value: Any,
    *,
    apply_chat_template: bool,
    input_template: str | None,
    max_len: int,
    force_eos: bool,
) -> MaskedTokens | None:
    prompt, response = render_response(
        prompt_value, response_value, tokenizer, apply_chat_template=apply_chat_template, input_template=input_template
    )
    sample = encode_prompt_response(tokenizer, prompt, response)
    if len(sample) > max_len:
        sample = truncate(sample, max_len)
        if force_eos and tokenizer.eos_token_id is not None:
            sample.input_ids[-1] = tokenizer.eos_token_id
    return sample if any(sample.loss_mask[1:]) else None


def pair_sample(
    row: dict[str, Any],
    tokenizer: Any,
    *,
    prompt_key: str | None,
    chosen_key: str,
    rejected_key: str,
    margin_key: str | None = None,
    apply_chat_template: bool = False,
    input_template: str | None = None,
    max_len: int = 512,
    force_eos: bool = False,
) -> Pair | None:
    """One row to a Pair; None when truncation leaves either side without a response token."""
    prompt_value = row[prompt_key] if prompt_key else None
    kw: dict[str, Any] = dict(
        apply_chat_template=apply_chat_template, input_template=input_template, max_len=max_len, force_eos=force_eos
    )
    chosen = _encode(tokenizer, prompt_value, row[chosen_key], **kw)
    rejected = _encode(tokenizer, prompt_value, row[rejected_key], **kw)
    if chosen is None or rejected is None:
        return None
    margin = float(row[margin_key]) if margin_key and row.get(margin_key) is not None else 0.0
    return Pair(chosen, rejected, margin)


def collate_pairs(pairs: Sequence[Pair], pad_id: int) -> dict[str, Any]:
    """2B right-padded rows (chosen block, then rejected block): ``input_ids``,
    ``attention_mask``, ``labels`` (shifted, response-only, for DPO's log-probs) and
    ``margin`` (B,)."""
    import torch

    batch = collate_padded([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
    margin = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    return {**batch, "margin": margin}
