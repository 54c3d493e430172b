"""Token-level samples for SFT (and the pair data built on them): which tokens carry loss,
and how samples become padded or packed micro-batches.

A sample is ``(input_ids, loss_mask)``: the mask marks response tokens (prompt tokens get
no loss). Response tokens are found on CHARACTER spans of the rendered text through the
fast tokenizer's offsets, so a BPE merge across the prompt/response boundary cannot shift
the mask by a token: a token that overlaps the response counts as response. (With
``--input_template 'User: {}\nAssistant: '`` the template's last space merges with the
response's first word into one token, " Answer"; that token is what the model must produce,
so it is learned.) Multi-turn chats mark every assistant turn.

Collation shifts labels per sample (``labels[t]`` = token t+1, ``IGNORE_INDEX`` at each
sample's last position and where the next token is not a response token), so the same
loss serves:

- padded rows: ``input_ids``/``attention_mask``/``labels`` (B, T), right-padded;
- packed rows (``--packing_samples``): ONE row (1, sum of lengths) with ``position_ids``
  restarting at 0 for every sample and no attention mask. transformers reads the restarts
  as sample boundaries: flash_attention_2 gets per-sample ``cu_seqlens``, and SDPA/eager
  (CPU) get a block-diagonal causal mask. Attention never crosses samples on either path
  (``tests/unit/supervised/test_sft_data.py`` checks packed logits equal per-sample logits). The forward
  must pass ``use_cache=False`` (``learner.runtime.models.label_logprobs`` does): with a KV cache
  transformers skips the packed-row detection and attends across samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.datasets import DataError, end_with_eos, render_response, to_messages

IGNORE_INDEX = -100  # same value as learner.algorithms.sft_loss.IGNORE_INDEX (that module imports torch)


@dataclass
class MaskedTokens:
    """One tokenized training sequence: its ids and which of them the loss is taken on."""

    input_ids: list[int]
    loss_mask: list[bool]

    def __len__(self) -> int:
        return len(self.input_ids)


def encode_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]) -> MaskedTokens:
    """Tokenize ``text`` (no added special tokens) and mark tokens overlapping ``spans``."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("response masks need a fast tokenizer (offset mapping); this one is slow")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(start < e and end > s for s, e in spans) for start, end in enc["offset_mapping"]]
    return MaskedTokens(list(enc["input_ids"]), mask)


def encode_prompt_response(tokenizer: Any, prompt: str, response: str) -> MaskedTokens:
    """``prompt + response`` with loss on the response only."""
    return encode_spans(tokenizer, prompt + response, [(len(prompt), len(prompt) + len(response))])


def encode_conversation(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> MaskedTokens:
    """A chat rendered with the tokenizer's template; loss on every assistant turn.

    Each assistant turn's span runs from the end of the conversation-so-far rendered with a
    generation prompt to the end of the conversation including that turn (its end-of-turn
    token included, trailing whitespace after it not), so what is learned is what the
    model generates and where it stops.
    """
    messages = to_messages(list(messages), "user")
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    eos = getattr(tokenizer, "eos_token", None)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = (
            tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        )
        end_text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(start_text) and full.startswith(end_text)):
            raise DataError(
                "the chat template does not render earlier turns as a prefix of the "
                "conversation; cannot mark assistant turns"
            )
        end = len(end_with_eos(end_text, eos)) if eos and eos in end_text[len(start_text) :] else len(end_text)
        spans.append((len(start_text), end))
    if not spans:
        raise DataError("a chat sample has no assistant message to learn")
    return encode_spans(tokenizer, full, spans)


def truncate(sample: MaskedTokens, max_len: int) -> MaskedTokens:
    return MaskedTokens(sample.input_ids[:max_len], sample.loss_mask[:max_len])


def sft_sample(
    row: dict[str, Any],
    tokenizer: Any,
    *,
    input_key: str,
    output_key: str | None,
    apply_chat_template: bool,
    input_template: str | None,
    max_len: int,
    pretrain_mode: bool = False,
) -> MaskedTokens | None:
    """One row to MaskedTokens; None when truncation leaves no response token (caller counts).

    ``output_key`` None means ``input_key`` holds a whole chat (a list of messages, all
    assistant turns learned) or, with ``pretrain_mode``, plain text learned in full.
    """
    value = row[input_key]
    if output_key is None:
        if pretrain_mode and isinstance(value, str):
            text = end_with_eos(value, getattr(tokenizer, "eos_token", None))
            sample = encode_spans(tokenizer, text, [(0, len(text))])
        else:
            if not apply_chat_template:
                raise DataError(
                    f"without --output_key, --input_key {input_key!r} must hold chat messages "
                    "and --apply_chat_template must be set (or use --pretrain_mode)"
                )
            sample = encode_conversation(tokenizer, value)
    else:
        prompt, response = render_response(
            value, row[output_key], tokenizer, apply_chat_template=apply_chat_template, input_template=input_template
        )
        sample = encode_prompt_response(tokenizer, prompt, response)
        if pretrain_mode:
            sample.loss_mask = [True] * len(sample)
    sample = truncate(sample, max_len)
    # The first token is never a target (nothing predicts it), so a sample needs a
    # response token after position 0.
    return sample if any(sample.loss_mask[1:]) else None


# --------------------------------------------------------------------------- collation


def shifted_labels(sample: MaskedTokens) -> list[int]:
    """Per-sample next-token targets: ``ids[t+1]`` where that token carries loss, else IGNORE."""
    ids, mask = sample.input_ids, sample.loss_mask
    return [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def collate_padded(samples: Sequence[MaskedTokens], pad_id: int) -> dict[str, Any]:
    """Right-padded (B, T) ``input_ids``, ``attention_mask``, ``labels`` (torch tensors)."""
    import torch

    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        labels[i, :n] = torch.tensor(shifted_labels(s))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def collate_packed(samples: Sequence[MaskedTokens]) -> dict[str, Any]:
    """One (1, L) row: ``input_ids``, ``position_ids`` restarting per sample, ``labels``
    (the row layout is ``learner.algorithms.packing.packed_row``, shared with the RL learner)."""
    import torch

    from learner.algorithms.packing import packed_row

    input_ids, position_ids = packed_row([s.input_ids for s in samples])
    labels = torch.tensor([t for s in samples for t in shifted_labels(s)], dtype=torch.long).unsqueeze(0)
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
