"""From scored samples to training tensors, and across learner ranks.

A ``Rollout`` is one global batch: N = B x G samples in groups of G consecutive samples
(one prompt each), with the prompt and response tokens, vLLM's sampling log-probs, the
reference log-probs and the scalar reward of every sample. Rank 0 (the controller) builds it
from the ledger; ``broadcast_rollout`` gives every learner rank the same copy as plain
tensors (no pickling). Every rank then computes advantages over the whole batch —
identically, so group and global statistics are exact with no extra collective — and trains
on its own slice.

``collate`` turns a list of samples into model inputs. Padded (the default): prompts
left-padded and responses right-padded, so every response starts at column P and the logits
predicting response token t sit at column P - 1 + t. Packed (``--packing_samples``): the
samples end to end in one row, position ids restarting per sample, no padding to compute
(``learner.algorithms.packing``); ``learner.runtime.models.check_packable`` refuses a model
whose attention would cross samples in such a row.

Shape glossary: N samples, P prompt width, T response width (both padded), L the packed row's
length, K the response tokens of the micro-batch.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from learner.algorithms.packing import packed_row, response_logit_index
from learner.controller.types import Rollout, ScoredSample
from learner.rl.micro_batches import plan_micro_batches
from learner.runtime import sequence_parallel

log = logging.getLogger("learner")

FINISH_CODES = {"stop": 0, "length": 1, "abort": 2}


def _token_ids(s: ScoredSample) -> torch.Tensor:
    """(P_i + T_i,) int64: the sample's prompt then its response."""
    return torch.cat((torch.tensor(s.prompt, dtype=torch.long), s.response.long()))


def _response_tensors(samples: list[ScoredSample], pad_id: int) -> dict[str, torch.Tensor]:
    """The padded (N, T) per-response-token tensors both layouts share: response (right-padded
    with ``pad_id``), action_mask, rollout_logprobs, ref_logprobs and teacher_logprobs (zeros where absent)."""
    n = len(samples)
    T = max(1, max(len(s.response) for s in samples))
    response = torch.full((n, T), pad_id, dtype=torch.long)  # (N, T)
    action_mask = torch.zeros((n, T), dtype=torch.bool)  # (N, T)
    rollout_lp = torch.zeros((n, T), dtype=torch.float32)  # (N, T)
    ref_lp = torch.zeros((n, T), dtype=torch.float32)  # (N, T)
    teacher_lp = torch.zeros((n, T), dtype=torch.float32)  # (N, T)
    for i, s in enumerate(samples):
        t = len(s.response)
        response[i, :t] = s.response
        action_mask[i, :t] = True if s.action_mask is None else s.action_mask[:t]
        rollout_lp[i, :t] = s.rollout_logprobs[:t]
        if s.ref_logprobs is not None:
            ref_lp[i, :t] = s.ref_logprobs[:t]
        if s.teacher_logprobs is not None:
            teacher_lp[i, :t] = s.teacher_logprobs[:t]
    out = dict(
        response=response,
        action_mask=action_mask,
        rollout_logprobs=rollout_lp,
        ref_logprobs=ref_lp,
        teacher_logprobs=teacher_lp,
    )
    if samples and all(s.teacher_topk_ids is not None for s in samples):  # top-k distillation
        K = samples[0].teacher_topk_ids.shape[-1]  # type: ignore[union-attr]
        ids = torch.zeros((n, T, K), dtype=torch.long)  # (N, T, K); id 0 in padding, never read
        lps = torch.zeros((n, T, K), dtype=torch.float32)  # (N, T, K)
        for i, s in enumerate(samples):
            t = len(s.response)
            ids[i, :t] = s.teacher_topk_ids[:t]  # type: ignore[index]
            lps[i, :t] = s.teacher_topk_logprobs[:t]  # type: ignore[index]
        out.update(teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    return out


def collate(
    samples: list[ScoredSample], pad_id: int, device: torch.device | str = "cpu", *, packed: bool = False
) -> dict[str, Any]:
    """Model inputs of a micro-batch, padded or packed (``--packing_samples``).

    Both layouts carry response/action_mask/rollout_logprobs/ref_logprobs (N, T), so losses
    and metrics see the same tensors either way. Padded: input_ids/attention_mask/position_ids
    (N, P+T) and ``prompt_width`` P. Packed (``packed=True``): ONE row, input_ids/position_ids
    (1, L) with L the sum of the samples' lengths, position ids restarting at 0 per sample and
    no attention mask (so that attention stays within each sample, see
    ``learner.algorithms.packing``), and ``logit_index`` (K,): the columns whose logits predict
    the response tokens, ``action_mask``'s True positions in row-major order.
    """
    resp = _response_tensors(samples, pad_id)
    if packed:
        input_ids, position_ids = packed_row([_token_ids(s) for s in samples])
        cols = response_logit_index([len(s.prompt) for s in samples], [len(s.response) for s in samples])
        if any(s.action_mask is not None for s in samples):  # agent episodes: the policy's tokens only
            keep = [
                s.action_mask.bool() if s.action_mask is not None else torch.ones(len(s.response), dtype=torch.bool)
                for s in samples
            ]
            cols = cols[torch.cat(keep)]
        out = dict(input_ids=input_ids, position_ids=position_ids, logit_index=cols, **resp)
        return {k: v.to(device) for k, v in out.items()}
    n, T = resp["response"].shape
    P = max(len(s.prompt) for s in samples)
    input_ids = torch.full((n, P + T), pad_id, dtype=torch.long)  # (N, P+T)
    attention_mask = torch.zeros((n, P + T), dtype=torch.long)  # (N, P+T)
    for i, s in enumerate(samples):
        p, t = len(s.prompt), len(s.response)
        input_ids[i, P - p : P] = torch.tensor(s.prompt, dtype=torch.long)
        attention_mask[i, P - p : P + t] = 1
    input_ids[:, P:] = resp["response"]
    # Left padding: positions count real tokens only, as in an unpadded forward.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (N, P+T)
    out = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **resp)
    out = {k: v.to(device) for k, v in out.items()}
    out["prompt_width"] = P
    return out


# ------------------------------------------------------------------ across ranks


@torch.no_grad()
def score_all_ranks(
    engine,
    rollout: Rollout,
    forward,
    *,
    micro_batch: int,
    pad_id: int,
    device: torch.device | str,
    packed: bool = False,
    max_tokens: int = 0,
) -> torch.Tensor:
    """(N, T) per-token scores (log-probs, values) of every sample, on every rank.

    Each rank runs ``forward(engine, batch) -> (n, T_b)`` over its strided slice of the
    rollout (micro-batches collated padded or ``packed``), then the slices are all-gathered.
    Micro-batches hold ``micro_batch`` samples, or with ``max_tokens`` > 0 the samples that fit
    that token budget (``--rollout.max_tokens_per_gpu``; ``learner.rl.micro_batches``). A
    collective: every rank runs the same number of forwards (ZeRO-3 forwards are collectives
    too), a rank short of samples repeating one of its own.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    group = None  # --ds.ring_attn_size: a sequence-parallel group scores one slice; gathered across groups
    if sequence_parallel.split_of(engine) is not None:
        rank, world, group = sequence_parallel.data_parallel()
    n = len(rollout)
    T = max(1, max(len(s.response) for s in rollout.samples))
    mine = list(range(rank, n, world))
    row = {i: r for r, i in enumerate(mine)}  # sample -> its row of `out`
    out = torch.zeros((len(mine), T), dtype=torch.float32, device=device)
    plan = plan_micro_batches(
        rollout.samples,
        mine,
        size=micro_batch,
        max_tokens=max_tokens,
        packed=packed,
        max_local=math.ceil(n / world),
        device=device,
    )
    engine.eval()
    for idx in plan:
        batch = collate([rollout.samples[i] for i in (idx or mine[:1])], pad_id, device, packed=packed)
        scores = forward(engine, batch)
        if idx:
            rows = torch.tensor([row[i] for i in idx], device=out.device)
            out[rows, : scores.shape[1]] = scores.float()
    engine.train()
    if world == 1:
        return out.cpu()
    rows = math.ceil(n / world)
    padded = torch.zeros((rows, T), dtype=torch.float32, device=device)
    padded[: len(mine)] = out
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    full = torch.zeros((n, T), dtype=torch.float32)
    for r in range(world):
        idx = list(range(r, n, world))
        full[idx] = gathered[r][: len(idx)].cpu()
    return full


_META_COLS = 7  # prompt_len, response_len, prompt_id, sample_index, policy_version, finish code, turns


def _pack(rollout: Rollout) -> list[torch.Tensor]:
    s = rollout.samples
    meta = torch.tensor(
        [
            [
                len(x.prompt),
                len(x.response),
                x.prompt_id,
                x.sample_index,
                x.policy_version,
                FINISH_CODES.get(x.finish_reason, 2),
                x.turns,
            ]
            for x in s
        ],
        dtype=torch.long,
    ).reshape(-1, _META_COLS)
    tokens = torch.cat([_token_ids(x) for x in s]) if s else torch.zeros(0, dtype=torch.long)
    lp = torch.cat([x.rollout_logprobs.float().reshape(-1) for x in s]) if s else torch.zeros(0)
    refs = [x.ref_logprobs for x in s if x.ref_logprobs is not None]
    has_ref = len(refs) == len(s)
    ref = torch.cat([r.float().reshape(-1) for r in refs]) if s and has_ref else torch.zeros(0)
    teachers = [x.teacher_logprobs for x in s if x.teacher_logprobs is not None]
    has_teacher = len(teachers) == len(s)
    teacher = torch.cat([r.float().reshape(-1) for r in teachers]) if s and has_teacher else torch.zeros(0)
    # top-k distillation's (T_i, K) rows, flattened: K is their numel over the response tokens
    top = [(x.teacher_topk_ids, x.teacher_topk_logprobs) for x in s]
    pairs = [(i, v) for i, v in top if i is not None and v is not None]
    has_topk = bool(s) and len(pairs) == len(s)
    topk_ids = torch.cat([i.long().reshape(-1) for i, _ in pairs]) if has_topk else torch.zeros(0, dtype=torch.long)
    topk_lps = torch.cat([v.float().reshape(-1) for _, v in pairs]) if has_topk else torch.zeros(0)
    rewards = torch.tensor([x.reward for x in s], dtype=torch.float32)
    # The agent samples' action masks (all ones for the others), one entry per response token.
    masks = [x.action_mask.float() if x.action_mask is not None else torch.ones(len(x.response)) for x in s]
    mask = torch.cat(masks) if s else torch.zeros(0)
    return [meta, tokens, lp, ref, rewards, mask, teacher, topk_ids, topk_lps]


def _unpack(tensors: list[torch.Tensor], group_size: int) -> Rollout:
    meta, tokens, lp, ref, rewards, mask, teacher, topk_ids, topk_lps = tensors
    n_tokens = int(meta[:, 1].sum()) if meta.numel() else 0
    K = topk_ids.numel() // n_tokens if n_tokens and topk_ids.numel() else 0
    topk_ids, topk_lps = topk_ids.reshape(-1, max(K, 1)), topk_lps.reshape(-1, max(K, 1))
    codes = {v: k for k, v in FINISH_CODES.items()}
    samples, tok_off, lp_off = [], 0, 0
    for i, (p, t, pid, idx, ver, fin, turns) in enumerate(meta.tolist()):
        prompt = tokens[tok_off : tok_off + p].tolist()
        response = tokens[tok_off + p : tok_off + p + t].to(torch.int32)
        tok_off += p + t
        samples.append(
            ScoredSample(
                pid,
                idx,
                prompt,
                response,
                lp[lp_off : lp_off + t].clone(),
                ref[lp_off : lp_off + t].clone() if ref.numel() else None,
                float(rewards[i]),
                codes.get(fin, "abort"),
                ver,
                action_mask=mask[lp_off : lp_off + t].bool() if turns else None,
                turns=turns,
                teacher_logprobs=teacher[lp_off : lp_off + t].clone() if teacher.numel() else None,
                teacher_topk_ids=topk_ids[lp_off : lp_off + t].to(torch.int32) if K else None,
                teacher_topk_logprobs=topk_lps[lp_off : lp_off + t].clone() if K else None,
            )
        )
        lp_off += t
    return Rollout(samples, group_size)


def broadcast_rollout(
    rollout: Rollout | None, group_size: int, src: int = 0, device: torch.device | str = "cpu"
) -> Rollout:
    """Every rank gets rank ``src``'s rollout. A collective: all ranks call it together."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert rollout is not None
        return rollout
    is_src = dist.get_rank() == src
    if is_src:
        assert rollout is not None, "rank src broadcasts its rollout"
    parts = _pack(rollout) if rollout is not None and is_src else []
    sizes = torch.tensor([p.numel() for p in parts] if is_src else [0] * 9, dtype=torch.long, device=device)
    dist.broadcast(sizes, src)
    dtypes = [torch.long, torch.long, *[torch.float32] * 5, torch.long, torch.float32]
    out = []
    for i, (n, dt) in enumerate(zip(sizes.tolist(), dtypes, strict=True)):
        buf = parts[i].reshape(-1).to(device) if is_src else torch.empty(n, dtype=dt, device=device)
        dist.broadcast(buf, src)
        out.append(buf.cpu())
    out[0] = out[0].reshape(-1, _META_COLS)
    if not is_src:
        return _unpack(out, group_size)
    assert rollout is not None
    return rollout
