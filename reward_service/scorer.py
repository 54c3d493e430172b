"""The socket-free core of the reward service: ``Scorer.score(ScoreRequest) -> ScoredBatch``.

A Scorer holds an optional reference scorer (per-token log-probs for the KL term), an optional
teacher (the same kind of model, ``load_logprob_model``: its log-probs for on-policy
distillation, docs/distillation.md) and any number of reward *sources*, built from the config by the ``SOURCES`` registry:

========  =========================================  ==========================
name      what                                       flags
========  =========================================  ==========================
rm        reward model, head at last non-pad token   --reward_pretrain
func      user ``reward_func`` in worker processes   --reward_func, .py in --remote_rm_url
remote    HTTP reward servers (OpenRLHF serve_rm)    --remote_rm_url URL[,URL]
========  =========================================  ==========================

Combination: a sample's reward is the **sum** of its sources' rewards (e.g. an RM plus a
format bonus); each source's own reward is logged in ``extra_logs["reward/<source>"]`` when
there are several. A sample fails if any source failed it (``failed[i]`` joins the reasons,
reward NaN). ``scores`` sums each source's ``scores``, or its rewards where it gave none
(OpenRLHF's default). A service with only ``--ref_pretrain`` and/or ``--teacher_pretrain``
returns rewards of 0.

Function and remote sources wait on other processes, so they run in threads while the
reference and reward models compute. How to use it in-process (tests, notebooks)::

    scorer = Scorer.from_config(RewardConfig(controller="-", reward_func="my_reward.py"))
    scored = scorer.score(ScoreRequest(samples=batch, prompts=[...], labels=[...]))
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol, Union

import torch

from common.protocol import RewardCapabilities, ScoredBatch, ScoreRequest
from reward_service.config import RewardConfig
from reward_service.inputs import BadRequest, ScoringInput, from_request, with_text
from reward_service.ref_model import ReferenceScorer

if TYPE_CHECKING:
    from reward_service.ref_vllm import VLLMReferenceScorer
from reward_service.results import NAN, SourceResult

log = logging.getLogger(__name__)


class RewardSource(Protocol):
    name: str  # "rm", "func:file.py", "remote": names the source in failure reasons and metrics
    needs_text: bool  # needs prompts / responses / queries text
    background: bool  # waits on other processes or servers: run in a thread, overlapping the models

    def score(self, inp: ScoringInput) -> SourceResult: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- sources


class RMSource:
    name, background = "rm", False

    def __init__(self, rm, tokenizer=None) -> None:
        self.rm = rm
        self.tokenizer = tokenizer  # the RM's own, when it reads the query text (--rm_from_text)
        self.needs_text = tokenizer is not None

    @property
    def vocab_size(self) -> int | None:
        return None if self.tokenizer is not None else self.rm.vocab_size  # text input: its own tokenizer

    def score(self, inp: ScoringInput) -> SourceResult:
        if self.tokenizer is not None:
            assert inp.queries is not None  # needs_text: the scorer filled them (with_text)
            seqs = [torch.tensor(self.tokenizer(q, add_special_tokens=False)["input_ids"]) for q in inp.queries]
        else:
            seqs = inp.sequences()
        return SourceResult(rewards=self.rm.rewards(seqs).tolist(), failed=[None] * len(inp))

    def close(self) -> None:
        pass


class TextSource:
    """Adapts a ``(queries, prompts, labels, **kw) -> SourceResult`` callable (func, remote)."""

    needs_text, background = True, True

    def __init__(self, impl) -> None:
        self.impl, self.name = impl, impl.name

    def score(self, inp: ScoringInput) -> SourceResult:
        return self.impl(
            inp.queries,
            inp.prompts,
            inp.labels,
            responses=inp.responses,
            prompt_ids=inp.prompt_ids,
            sample_indices=inp.sample_indices,
            finish_reasons=inp.finish_reasons,
        )

    def close(self) -> None:
        self.impl.close()


def _dtype(cfg: RewardConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float32


def device_of(cfg: RewardConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def _rm_sources(cfg: RewardConfig) -> list[RewardSource]:
    if not cfg.reward_pretrain:
        return []
    from reward_service.reward_model import RewardModelScorer

    rm = RewardModelScorer.load(
        cfg.reward_pretrain,
        dtype=_dtype(cfg),
        device=device_of(cfg),
        attn_implementation=cfg.attn_implementation,
        micro_batch_size=cfg.micro_batch_size,
        max_tokens=cfg.max_tokens_per_gpu,
        value_head_prefix=cfg.value_head_prefix,
        normalize=cfg.normalize_reward,
    )
    tok = None
    if cfg.rm_from_text:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.reward_pretrain)
    return [RMSource(rm, tok)]


def _func_sources(cfg: RewardConfig) -> list[RewardSource]:
    from reward_service.func_reward import FunctionReward

    out: list[RewardSource] = []
    try:
        for path in cfg.func_files():
            env = {"RAYLESS_SANDBOX_WORKERS": str(cfg.sandbox_workers)}  # common.sandbox.Sandbox.from_env
            out.append(TextSource(FunctionReward(path, timeout_s=cfg.timeout_s, workers=cfg.func_workers, env=env)))
    except BaseException:
        for s in out:
            s.close()
        raise
    return out


def _remote_sources(cfg: RewardConfig) -> list[RewardSource]:
    from reward_service.remote import RemoteReward

    urls = cfg.urls()
    return (
        [TextSource(RemoteReward(urls, timeout_s=cfg.timeout_s, retries=cfg.retries, backoff_s=cfg.retry_backoff_s))]
        if urls
        else []
    )


def _judge_sources(cfg: RewardConfig) -> list[RewardSource]:
    if not cfg.judge_url:
        return []
    from reward_service.judge import JudgeReward, load_template

    assert cfg.judge_prompt  # RewardConfig checks it
    judge = JudgeReward(
        cfg.judge_url,
        model=cfg.judge_model,
        template=load_template(cfg.judge_prompt),
        parser=cfg.judge_parser,
        scale=cfg.judge_score_scale,
        max_tokens=cfg.judge_max_tokens,
        temperature=cfg.judge_temperature,
        concurrency=cfg.judge_concurrency,
        timeout_s=cfg.timeout_s,
        retries=cfg.retries,
        backoff_s=cfg.retry_backoff_s,
    )
    return [TextSource(judge)]


LogprobModel = Union[ReferenceScorer, "VLLMReferenceScorer"]


def load_logprob_model(cfg: RewardConfig, role: str) -> LogprobModel:
    """A scoring model: per-token log-probs of each response (``logprobs(prompts, responses)``).
    ``role`` "ref" (--ref_*) or "teacher" (--teacher_*): the same code, its own flags."""
    path = cfg.ref_pretrain if role == "ref" else cfg.teacher_pretrain
    assert path
    if getattr(cfg, f"{role}_backend") == "vllm":
        from reward_service.ref_vllm import VLLMReferenceScorer

        name = cfg.name or "reward service"
        return VLLMReferenceScorer.load(
            path,
            dtype="bfloat16" if cfg.bf16 else "float32",
            tensor_parallel_size=getattr(cfg, f"{role}_tensor_parallel_size"),
            max_model_len=getattr(cfg, f"{role}_max_model_len") or None,
            gpu_memory_utilization=getattr(cfg, f"{role}_gpu_memory_utilization"),
            enforce_eager=getattr(cfg, f"{role}_enforce_eager"),
            idle_spin_s=cfg.ref_idle_spin_s,
            who=name if role == "ref" else f"{name} (teacher)",
            flag=f"--{role}_gpu_memory_utilization",
        )
    return ReferenceScorer.load(
        path,
        dtype=_dtype(cfg),
        device=device_of(cfg),
        attn_implementation=cfg.attn_implementation,
        micro_batch_size=cfg.micro_batch_size,
        max_tokens=cfg.max_tokens_per_gpu,
        temperature=cfg.temperature,
        tile_tokens=cfg.logits_tile_tokens,
    )


def check_teacher_vocabulary(cfg: RewardConfig, teacher: LogprobModel) -> None:
    """The teacher scores the policy's token ids: its tokenizer must be the policy's (--tokenizer,
    else --ref_pretrain's) and its vocabulary must hold every id of it. Raises ValueError naming
    both paths (start-up, exit 2)."""
    policy = cfg.tokenizer or cfg.ref_pretrain
    assert cfg.teacher_pretrain
    if policy:
        from common.vocab import check_same_tokenizer

        check_same_tokenizer(
            policy, cfg.teacher_pretrain, student_flag="--tokenizer" if cfg.tokenizer else "--ref_pretrain"
        )
    # Without either, the request's ids are checked against the teacher's vocabulary (_check_token_ids).


# name -> builder(config) -> sources. Cheap checks first: a bad reward file fails start-up
# before minutes of model loading.
SOURCES: dict[str, Callable[[RewardConfig], list[RewardSource]]] = {
    "func": _func_sources,
    "remote": _remote_sources,
    "judge": _judge_sources,
    "rm": _rm_sources,
}


# --------------------------------------------------------------------------- scorer


class Scorer:
    def __init__(
        self,
        *,
        ref: LogprobModel | None = None,
        teacher: LogprobModel | None = None,
        teacher_topk: int = 0,
        sources: Sequence[RewardSource] = (),
        tokenizer=None,
        name: str = "reward",
    ) -> None:
        self.ref = ref
        self.teacher = teacher  # on-policy distillation: the same kind of model, another checkpoint
        self.teacher_topk = teacher_topk  # > 0: also its top-k ids and log-probs per position
        self.sources = list(sources)
        self.tokenizer = tokenizer  # the policy's: decodes token ids for text sources
        self.name = name
        n_bg = sum(s.background for s in self.sources)
        self._pool = ThreadPoolExecutor(max_workers=n_bg, thread_name_prefix="reward-src") if n_bg else None
        self.counters: Counter[str] = Counter()
        self.last_batch_s = 0.0

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> Scorer:
        sources: list[RewardSource] = []
        try:
            for build in SOURCES.values():
                sources += build(cfg)
            ref = load_logprob_model(cfg, "ref") if cfg.ref_pretrain else None
            teacher = load_logprob_model(cfg, "teacher") if cfg.teacher_pretrain else None
            if teacher is not None:
                check_teacher_vocabulary(cfg, teacher)
                if cfg.teacher_topk > teacher.vocab_size:
                    raise ValueError(
                        f"--teacher_topk {cfg.teacher_topk} is more ids than the teacher's vocabulary of "
                        f"{teacher.vocab_size}"
                    )
            tokenizer = None
            if cfg.tokenizer_path() and any(s.needs_text for s in sources):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path())
        except BaseException:
            for s in sources:
                s.close()
            for m in (locals().get("ref"), locals().get("teacher")):
                if m is not None and hasattr(m, "close"):
                    m.close()
            raise
        return cls(
            ref=ref,
            teacher=teacher,
            teacher_topk=cfg.teacher_topk,
            sources=sources,
            tokenizer=tokenizer,
            name=cfg.name or "reward",
        )

    def capabilities(self) -> RewardCapabilities:
        """What the Hello announces: which sources this service computes (the server adds its
        capacity)."""
        from reward_service.ref_vllm import VLLMReferenceScorer  # light: vLLM itself loads with the engine

        caps = RewardCapabilities(
            sources=(["ref"] if self.ref else [])
            + (["teacher"] if self.teacher else [])
            + [s.name for s in self.sources],
            ref_logprobs=self.ref is not None,
            teacher_logprobs=self.teacher is not None,
            teacher_topk=self.teacher_topk if self.teacher is not None else 0,
            rewards=bool(self.sources),
        )
        if isinstance(self.ref, VLLMReferenceScorer):  # what its workers spin after scoring, the share it took
            caps.ref_idle_spin_s = self.ref.idle_spin_s
            caps.ref_gpu_memory_utilization = self.ref.memory_share
        return caps

    def score(self, req: ScoreRequest) -> ScoredBatch:
        """Scores every sample. Raises BadRequest for a request that cannot be scored as sent;
        failures of reward functions / servers are per-sample (``failed``), not exceptions."""
        t0 = time.monotonic()
        inp = from_request(req)
        n = len(inp)
        for model, what in ((self.ref, "reference"), (self.teacher, "teacher")):
            if model is not None and inp.prompt_tokens is None:
                raise BadRequest(f"{what} log-probs need samples.prompt_token_ids (the prompt tokens)")
        self._check_token_ids(inp)
        if any(s.needs_text for s in self.sources):
            with_text(inp, self.tokenizer)
        futs = (
            {id(s): self._pool.submit(s.score, inp) for s in self.sources if s.background}
            if self._pool is not None  # None: no background source
            else {}
        )
        ref_logprobs = self.ref.logprobs(inp.prompt_tokens, inp.response_tokens) if self.ref else None
        teacher_logprobs = topk_ids = topk_lps = None
        if self.teacher is not None and self.teacher_topk:
            assert isinstance(self.teacher, ReferenceScorer)  # the config allows the hf backend only
            teacher_logprobs, topk_ids, topk_lps = self.teacher.topk(
                inp.prompt_tokens, inp.response_tokens, self.teacher_topk
            )
        elif self.teacher is not None:
            teacher_logprobs = self.teacher.logprobs(inp.prompt_tokens, inp.response_tokens)
        results = [(s, s.score(inp)) for s in self.sources if not s.background]
        results += [(s, futs[id(s)].result()) for s in self.sources if s.background]
        scored = self._combine(inp, results, ref_logprobs, teacher_logprobs)
        scored.teacher_topk_ids, scored.teacher_topk_logprobs = topk_ids, topk_lps
        self.last_batch_s = time.monotonic() - t0
        self.counters["requests"] += 1
        self.counters["samples"] += n
        return scored

    def _check_token_ids(self, inp: ScoringInput) -> None:
        """An id outside a model's vocabulary would raise deep in its embedding (an "internal"
        error, counted towards fatal): it is the request's fault, so say so up front."""
        vocabs = [(self.ref.vocab_size, "reference model")] if self.ref is not None else []
        vocabs += [(self.teacher.vocab_size, "teacher")] if self.teacher is not None else []
        vocabs += [(v, s.name) for s in self.sources if (v := getattr(s, "vocab_size", None))]
        if not vocabs or not len(inp):
            return
        toks = inp.response_tokens + (inp.prompt_tokens or [])
        flat = torch.cat([t.reshape(-1).long() for t in toks])
        if not flat.numel():
            return
        lo, hi = int(flat.min()), int(flat.max())
        for v, what in vocabs:
            if lo < 0 or hi >= v:
                raise BadRequest(
                    f"token ids span [{lo}, {hi}], outside the {what}'s vocabulary of {v}: "
                    "is this service loaded with the policy's model family?"
                )

    def _combine(
        self,
        inp: ScoringInput,
        results: list[tuple[RewardSource, SourceResult]],
        ref_logprobs: torch.Tensor | None,
        teacher_logprobs: torch.Tensor | None = None,
    ) -> ScoredBatch:
        n = len(inp)
        rewards, scores = [0.0] * n, [0.0] * n
        failed: list[str | None] = [None] * n
        extra: dict[str, list[float]] = {}
        for src, res in results:
            src_scores = res.scores if res.scores is not None else res.rewards
            for i in range(n):
                rewards[i] += res.rewards[i]
                scores[i] += src_scores[i]
                if res.failed[i]:
                    failed[i] = res.failed[i] if failed[i] is None else f"{failed[i]}; {res.failed[i]}"
                    self.counters[f"failed:{src.name}"] += 1
            if len(results) > 1:
                extra[f"reward/{src.name}"] = list(res.rewards)
            for k, v in res.extra_logs.items():
                extra[k if k not in extra else f"{src.name}/{k}"] = v
        for i in range(n):
            if failed[i] is not None:
                rewards[i] = scores[i] = NAN
                self.counters["samples_failed"] += 1
            elif not math.isfinite(rewards[i]):  # e.g. an RM that overflowed in bf16
                failed[i], rewards[i], scores[i] = f"reward is {rewards[i]}", NAN, NAN
                self.counters["samples_failed"] += 1
        return ScoredBatch(
            prompt_ids=inp.prompt_ids,
            sample_indices=inp.sample_indices,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            ref_logprobs=ref_logprobs,
            failed=failed,
            scores=torch.tensor(scores, dtype=torch.float32),
            extra_logs=extra,
            server=self.name,
            teacher_logprobs=teacher_logprobs,
        )

    def stats(self) -> dict[str, float]:
        """Counters for the heartbeat: requests, samples, samples_failed, failed:<source>, last_batch_s."""
        out = {k: float(v) for k, v in self.counters.items()}
        out.setdefault("samples_failed", 0.0)
        out["last_batch_s"] = round(self.last_batch_s, 4)
        return out

    def close(self) -> None:
        for s in self.sources:
            s.close()
        for model in (self.ref, self.teacher):
            close = getattr(model, "close", None)  # a vLLM engine has processes to stop
            if close is not None:
                close()
        if self._pool:
            self._pool.shutdown(wait=False, cancel_futures=True)
