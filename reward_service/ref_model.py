"""Reference scorer: per-token log-probs of each response under the frozen reference model.

For the KL term of PPO / GRPO: ``ref_logprobs[t] = log softmax(logits[t-1] / temperature)[token t]``
for every response token, with the prompt as context. The output is columnar like
``SampleBatch.response_ids``: the responses' log-probs concatenated, shape ``(L,)``.

Batching: length-sorted micro-batches (``micro_batch_size`` sequences, or with ``max_tokens``
the sequences that fit that many padded tokens), *left*-padded, so every response ends at the last
column and the model's own forward can be asked for the logits of the last
``max_response_len + 1`` positions only (``logits_to_keep``). That keeps the ``(B, T, V)``
logits tensor, the memory peak of this job, down to the response part, and still runs the
model's real forward (any logit soft-capping or scaling it does is included), rather than a
hand-rolled ``backbone -> lm_head``. Position ids follow the mask, so padding does not shift
positions: results equal an unpadded forward up to fp32 rounding of different kernel shapes
(and exactly when a micro-batch holds one sequence).

With ``tile_tokens`` > 0 (``--logits_tile_tokens``, on by default) not even the response part's
logits are built whole: the same forward runs with the output head's input captured and the
responses' hidden states go through the head ``tile_tokens`` rows at a time
(``common.tiled_logits``), the same numbers to fp32 rounding. A model whose forward changes the
logits after the head (soft-capping, a logit scale) keeps the whole logits, said once at load.
"""

from __future__ import annotations

import logging

import torch

from common.tiled_logits import head_inputs, token_logprobs, untileable_reason
from reward_service.batching import chunks, pad

log = logging.getLogger(__name__)


class ReferenceScorer:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        pad_id: int = 0,
        max_tokens: int = 0,
        tile_tokens: int = 0,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        reason = untileable_reason(self.model) if tile_tokens > 0 else None
        if reason is not None:
            log.warning("--logits_tile_tokens: the reference model's logits are built whole: %s", reason)
        self.tile_tokens = tile_tokens if reason is None else 0
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens  # > 0: micro-batches by padded tokens (--max_tokens_per_gpu)
        self.temperature = temperature
        self.pad_id = pad_id

    @classmethod
    def load(
        cls,
        path: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        attn_implementation: str | None = None,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        max_tokens: int = 0,
        tile_tokens: int = 0,
    ) -> ReferenceScorer:
        from transformers import AutoModelForCausalLM

        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(device)
        pad_id = model.config.pad_token_id
        if pad_id is None:  # any id works: padded positions are masked and never read
            pad_id = 0
        log.info("reference model %s loaded (%s, %s)", path, dtype, device)
        return cls(
            model,
            micro_batch_size=micro_batch_size,
            temperature=temperature,
            pad_id=int(pad_id),
            max_tokens=max_tokens,
            tile_tokens=tile_tokens,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @torch.no_grad()
    def logprobs(self, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> torch.Tensor:
        """Log-probs of every response token, concatenated in input order: ``(L,)`` float32.

        ``prompts[i]`` and ``responses[i]`` are 1-D int tensors; a prompt must be non-empty
        (the first response token needs context), a response may be empty.
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"sample {i} has an empty prompt: its first response token has no context")
        out: list[torch.Tensor | None] = [None] * len(prompts)
        seqs = [torch.cat([p.long(), r.long()]) for p, r in zip(prompts, responses, strict=True)]
        for chunk in chunks([len(s) for s in seqs], self.micro_batch_size, self.max_tokens):
            for i, lp in zip(chunk, self._chunk([seqs[i] for i in chunk], [responses[i] for i in chunk]), strict=True):
                out[i] = lp
        if not out:
            return torch.empty(0, dtype=torch.float32)
        return torch.cat(out)  # (L,)

    def _chunk(self, seqs: list[torch.Tensor], responses: list[torch.Tensor]) -> list[torch.Tensor]:
        max_r = max(len(r) for r in responses)
        if max_r == 0:
            return [torch.empty(0, dtype=torch.float32) for _ in responses]
        ids, mask, pos = pad(seqs, self.pad_id, "left", self.device)  # (B, T)
        if self.tile_tokens > 0:
            return self._tiled(ids, mask, pos, responses, max_r)
        # Logits at columns T-1-max_r .. T-2 predict the last max_r tokens of every row; the
        # last column (predicting past the end) is computed too, cheaper than slicing inputs.
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=max_r + 1, use_cache=False
        ).logits  # (B, max_r + 1, V)
        res = []
        for b, r in enumerate(responses):
            n = len(r)
            if n == 0:
                res.append(torch.empty(0, dtype=torch.float32))
                continue
            # Row b's response occupies the last n columns of the input; the logits that
            # predict them are the n columns before the final one.
            lg = logits[b, max_r - n : max_r].float()  # (n, V); log-softmax in fp32 even for bf16 models
            if self.temperature != 1.0:
                lg = lg / self.temperature
            lp = lg.log_softmax(-1).gather(-1, r.to(lg.device).long()[:, None])[:, 0]  # (n,)
            res.append(lp.cpu())
        return res

    @torch.no_grad()
    def topk(
        self, prompts: list[torch.Tensor], responses: list[torch.Tensor], k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``logprobs``' ``(L,)`` and, at each response position, the ``k`` most likely ids and
        their log-probs (at ``temperature``), most likely first: ``(L, k)`` int32 and float32.

        For top-k distillation (``learner.algorithms.distill.topk_divergence``). The same forward
        as ``logprobs``; with ``tile_tokens`` the rows go through the head a tile at a time, so
        the (tokens x vocabulary) logits of a micro-batch never exist whole here either."""
        if not 0 < k <= self.vocab_size:
            raise ValueError(f"top-k of {k} ids: must be in [1, {self.vocab_size}] (the vocabulary)")
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"sample {i} has an empty prompt: its first response token has no context")
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(prompts)
        seqs = [torch.cat([p.long(), r.long()]) for p, r in zip(prompts, responses, strict=True)]
        for chunk in chunks([len(s) for s in seqs], self.micro_batch_size, self.max_tokens):
            rs = [responses[i] for i in chunk]
            for i, res in zip(chunk, self._chunk_topk([seqs[i] for i in chunk], rs, k), strict=True):
                out[i] = res
        parts = [x for x in out if x is not None]
        if not parts:
            return torch.empty(0), torch.empty(0, k, dtype=torch.int32), torch.empty(0, k)
        return (
            torch.cat([p[0] for p in parts]),  # (L,)
            torch.cat([p[1] for p in parts]),  # (L, k)
            torch.cat([p[2] for p in parts]),  # (L, k)
        )

    def _chunk_topk(
        self, seqs: list[torch.Tensor], responses: list[torch.Tensor], k: int
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        lengths = [len(r) for r in responses]
        max_r = max(lengths)
        if max_r == 0:
            return [(torch.empty(0), torch.empty(0, k, dtype=torch.int32), torch.empty(0, k)) for _ in responses]
        ids, mask, pos = pad(seqs, self.pad_id, "left", self.device)  # (B, T)
        labels = torch.cat([r.long() for r in responses]).to(self.device)  # (L,)
        kw = dict(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=max_r + 1, use_cache=False)
        # Row b's n response tokens are predicted by the n columns before the final one (as _chunk).
        if self.tile_tokens > 0:
            head = self.model.get_output_embeddings()
            hidden = head_inputs(self.model, head, **kw)  # (B, max_r + 1, H)
            rows = torch.cat([hidden[b, max_r - n : max_r] for b, n in enumerate(lengths)])  # (L, H)
            tiles = [(head(rows[a : a + self.tile_tokens]), a) for a in range(0, len(rows), self.tile_tokens)]
        else:
            logits = self.model(**kw).logits  # (B, max_r + 1, V)
            tiles = [(torch.cat([logits[b, max_r - n : max_r] for b, n in enumerate(lengths)]), 0)]  # (L, V)
        lps, top_lp, top_ids = [], [], []
        for z, a in tiles:
            lsm = (z.float() / self.temperature).log_softmax(-1)  # (n, V), fp32 for bf16 models
            lps.append(lsm.gather(-1, labels[a : a + len(z), None])[:, 0])
            v, i = lsm.topk(k, dim=-1)  # (n, k), most likely first
            top_lp.append(v)
            top_ids.append(i)
        lp, tv, ti = torch.cat(lps).cpu(), torch.cat(top_lp).cpu(), torch.cat(top_ids).int().cpu()
        return list(zip(lp.split(lengths), ti.split(lengths), tv.split(lengths), strict=True))

    def _tiled(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, responses: list[torch.Tensor], max_r: int
    ) -> list[torch.Tensor]:
        """``_chunk``'s numbers without its (B, max_r + 1, V) logits: the same forward up to the
        head's input, then the responses' rows through the head a tile at a time."""
        head = self.model.get_output_embeddings()
        hidden = head_inputs(
            self.model,
            head,
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            logits_to_keep=max_r + 1,
            use_cache=False,
        )  # (B, max_r + 1, H)
        # Row b's n response tokens are predicted by the n columns before the final one, as in _chunk.
        rows = torch.cat([hidden[b, max_r - len(r) : max_r] for b, r in enumerate(responses)])  # (L, H)
        labels = torch.cat([r.long() for r in responses]).to(rows.device)  # (L,)
        lp, _ = token_logprobs(head, rows, labels, temperature=self.temperature, tile_tokens=self.tile_tokens)
        return list(lp.cpu().split([len(r) for r in responses]))
