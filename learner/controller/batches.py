"""Slicing and joining columnar batches (SampleBatch, ScoredBatch) by sample rows.

The wire batches are columnar — response tokens of all samples concatenated — so moving a
prompt's samples from one batch to another means slicing by offsets. These helpers keep that
arithmetic in one place.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from common.protocol import EpisodeOutputs, SampleBatch, ScoredBatch


def _offsets(lengths: list[int]) -> list[int]:
    out, acc = [], 0
    for n in lengths:
        out.append(acc)
        acc += n
    return out


def _take_flat(
    flat: torch.Tensor | None, lengths: list[int], rows: list[int], offs: list[int] | None = None
) -> torch.Tensor | None:
    """The rows ``rows`` of a flat (columnar) tensor with rows of ``lengths``: a view when the
    rows are consecutive (a prompt's samples, as services return them), else a new tensor. A view
    keeps the whole of ``flat`` alive while it lives (a received frame: until every prompt it
    held is trained or dropped). ``offs``: ``_offsets(lengths)``, when the caller takes many row
    sets of one tensor."""
    if flat is None:
        return None
    offs = _offsets(lengths) if offs is None else offs
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return flat[offs[rows[0]] : offs[rows[-1]] + lengths[rows[-1]]]
    parts = [flat[offs[r] : offs[r] + lengths[r]] for r in rows]
    return torch.cat(parts) if parts else flat[:0]


def select_samples(b: SampleBatch, rows: list[int]) -> SampleBatch:
    return SampleBatch(
        prompt_ids=[b.prompt_ids[r] for r in rows],
        sample_indices=[b.sample_indices[r] for r in rows],
        response_lengths=[b.response_lengths[r] for r in rows],
        response_ids=_take_flat(b.response_ids, b.response_lengths, rows),
        logprobs=_take_flat(b.logprobs, b.response_lengths, rows),
        finish_reasons=[b.finish_reasons[r] for r in rows] if b.finish_reasons else [],
        policy_versions=[b.policy_versions[r] for r in rows] if b.policy_versions else [],
        prompt_token_ids=[b.prompt_token_ids[r] for r in rows] if b.prompt_token_ids is not None else None,
        server=b.server,
        **_agent_rows(b, rows),
    )


def _agent_rows(b: SampleBatch, rows: list[int]) -> dict:
    """The episodes' outputs of rows ``rows`` (none for a batch of plain samples)."""
    ep = b.episodes
    if ep is None:
        return {}

    def take(values: list) -> list:
        return [values[r] for r in rows] if values else []

    return {
        "episodes": EpisodeOutputs(
            action_mask=_take_flat(ep.action_mask, b.response_lengths, rows),
            rewards=take(ep.rewards),
            scores=take(ep.scores),
            turns=take(ep.turns),
            logs=take(ep.logs),
        )
    }


def _agent_concat(batches: list[SampleBatch]) -> dict:
    """The episodes' part of ``concat_samples``: all batches are agent episodes, or none is. A
    reward service reads each episode's own prompt, not its outputs (mask, rewards, turns): those
    stay here."""
    agent = [b.episodes is not None for b in batches]
    if not any(agent):
        return {}
    if not all(agent):
        raise ValueError("cannot join agent episodes and plain samples in one batch")
    return {"prompt_token_ids": [t for b in batches for t in (b.prompt_token_ids or [])]}


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    # One tensor needs no copy; torch.cat promotes mixed dtypes (int32 + int64 -> int64).
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def concat_samples(batches: list[SampleBatch]) -> SampleBatch:
    """One batch of all the samples of ``batches``, in order, as a reward service gets them:
    token ids keep the dtype the rollout servers sent (int32: half the bytes of int64), the
    sampler's log-probs are left out (no reward service reads them: a third of the bytes at
    long answers), and so are agent episodes' outputs (their own prompts stay)."""

    def cat(name):
        return [x for b in batches for x in getattr(b, name)]

    return SampleBatch(
        prompt_ids=cat("prompt_ids"),
        sample_indices=cat("sample_indices"),
        response_lengths=cat("response_lengths"),
        response_ids=_cat([b.response_ids for b in batches]),
        logprobs=None,
        finish_reasons=cat("finish_reasons") if all(b.finish_reasons for b in batches) else [],
        policy_versions=cat("policy_versions") if all(b.policy_versions for b in batches) else [],
        server=",".join(sorted({b.server for b in batches})),
        **_agent_concat(batches),
    )


def split_by_prompt(b: SampleBatch) -> dict[int, SampleBatch]:
    """Prompt id -> its samples. A batch of one prompt's samples (what a rollout server sends for
    each finished prompt) is returned as it is: no copy of its tokens."""
    rows: dict[int, list[int]] = defaultdict(list)
    for i, pid in enumerate(b.prompt_ids):
        rows[pid].append(i)
    if len(rows) == 1:
        return {b.prompt_ids[0]: b} if b.prompt_ids else {}
    return {pid: select_samples(b, r) for pid, r in rows.items()}


def split_scored_by_prompt(s: ScoredBatch, response_lengths: list[int]) -> dict[int, ScoredBatch]:
    """Splits a ScoredBatch whose rows match a SampleBatch with ``response_lengths``."""
    rows: dict[int, list[int]] = defaultdict(list)
    for i, pid in enumerate(s.prompt_ids):
        rows[pid].append(i)
    ref = s.ref_logprobs.reshape(-1) if s.ref_logprobs is not None else None
    teacher = s.teacher_logprobs.reshape(-1) if s.teacher_logprobs is not None else None
    topk_ids, topk_lps = s.teacher_topk_ids, s.teacher_topk_logprobs  # (L, K): rows as the flat ones
    offs = _offsets(response_lengths) if ref is not None or teacher is not None or topk_ids is not None else None
    out = {}
    for pid, r in rows.items():
        out[pid] = ScoredBatch(
            prompt_ids=[pid] * len(r),
            sample_indices=[s.sample_indices[i] for i in r],
            rewards=s.rewards[r].float(),
            # a view of the received frame (read-only memory) for a prompt's consecutive rows
            ref_logprobs=_take_flat(ref, response_lengths, r, offs),
            failed=[s.failed[i] for i in r] if s.failed else [],
            scores=s.scores[r].float() if s.scores is not None else None,
            extra_logs={k: [v[i] for i in r] for k, v in s.extra_logs.items()},
            server=s.server,
            teacher_logprobs=_take_flat(teacher, response_lengths, r, offs),
            teacher_topk_ids=_take_flat(topk_ids, response_lengths, r, offs),
            teacher_topk_logprobs=_take_flat(topk_lps, response_lengths, r, offs),
        )
    return out
