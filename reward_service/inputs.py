"""ScoreRequest -> ScoringInput: per-sample tokens and, when a source needs it, text.

Text comes from the request when the controller sends it (``prompts``, ``queries``), else is
decoded with the policy's tokenizer (``--tokenizer``):

- ``prompts[i]``: ``decode(prompt_token_ids[i], skip_special_tokens=False)`` -- the chat
  template's markers stay, as in OpenRLHF, whose prompts are templated text;
- ``responses[i]``: ``decode(response_ids[i], skip_special_tokens=True)`` -- as vLLM returns
  text (no EOS marker);
- ``queries[i]``: ``prompts[i] + responses[i]`` (OpenRLHF's ``queries``).

Anything a configured source needs but cannot be had raises ``BadRequest`` naming it; the
service answers it with ``Error(code="bad_request")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.protocol import ScoreRequest


class BadRequest(ValueError):
    """The request cannot be scored as sent; the message says what is missing or wrong."""


@dataclass
class ScoringInput:
    prompt_ids: list[int]  # (N,)
    sample_indices: list[int]  # (N,)
    finish_reasons: list[str] | None  # (N,) or None when the batch has none
    response_tokens: list[torch.Tensor]  # (N,) 1-D int tensors, possibly empty
    prompt_tokens: list[torch.Tensor] | None  # (N,) 1-D int tensors; None when the request has none
    labels: list[Any]  # (N,) None where the dataset has no label
    prompts: list[str] | None = None  # (N,) filled by with_text()
    responses: list[str] | None = None
    queries: list[str] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def sequences(self) -> list[torch.Tensor]:
        """prompt + response tokens of every sample (for the reward model)."""
        if self.prompt_tokens is None:
            raise BadRequest("scoring with a reward model needs samples.prompt_token_ids (the prompt tokens)")
        return [torch.cat([p, r.long()]) for p, r in zip(self.prompt_tokens, self.response_tokens, strict=True)]


def from_request(req: ScoreRequest) -> ScoringInput:
    sb = req.samples
    n = len(sb)
    for name in ("prompts", "labels", "queries"):
        got = getattr(req, name)
        if got and len(got) != n:
            raise BadRequest(f"ScoreRequest.{name} has {len(got)} entries for {n} samples")
    prompt_tokens = None
    if sb.prompt_token_ids is not None:
        for i, p in enumerate(sb.prompt_token_ids):
            if not p:
                raise BadRequest(f"samples.prompt_token_ids[{i}] is empty (prompt id {sb.prompt_ids[i]})")
        prompt_tokens = [torch.tensor(p, dtype=torch.long) for p in sb.prompt_token_ids]
    return ScoringInput(
        prompt_ids=list(sb.prompt_ids),
        sample_indices=list(sb.sample_indices),
        finish_reasons=list(sb.finish_reasons) or None,
        response_tokens=sb.split_responses(),
        prompt_tokens=prompt_tokens,
        labels=list(req.labels) if req.labels else [None] * n,
        prompts=list(req.prompts) or None,
        queries=list(req.queries) or None,
    )


def with_text(inp: ScoringInput, tokenizer) -> ScoringInput:
    """Fills prompts / responses / queries (in place; returns ``inp``)."""
    if inp.prompts is None:
        if tokenizer is None or inp.prompt_tokens is None:
            raise BadRequest(_missing("prompts", "samples.prompt_token_ids", tokenizer))
        inp.prompts = tokenizer.batch_decode([p.tolist() for p in inp.prompt_tokens], skip_special_tokens=False)
    if inp.responses is None:
        if tokenizer is not None:
            inp.responses = tokenizer.batch_decode([r.tolist() for r in inp.response_tokens], skip_special_tokens=True)
        elif inp.queries is not None and all(q.startswith(p) for q, p in zip(inp.queries, inp.prompts, strict=True)):
            inp.responses = [q[len(p) :] for q, p in zip(inp.queries, inp.prompts, strict=True)]
        else:
            raise BadRequest(_missing("queries", "", tokenizer))
    if inp.queries is None:
        inp.queries = [p + r for p, r in zip(inp.prompts, inp.responses, strict=True)]
    return inp


def _missing(field: str, tokens: str, tokenizer) -> str:
    if tokenizer is None:
        return (
            f"reward functions need text: send ScoreRequest.{field}, or start the service with --tokenizer "
            "(the policy's) so it can decode token ids"
        )
    return f"reward functions need text: send ScoreRequest.{field} or {tokens}"
