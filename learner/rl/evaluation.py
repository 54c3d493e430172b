"""Evaluation during RL: which steps evaluate, what is measured, and which checkpoint is best.

``--eval_dataset`` prompts go through the same rollout servers and reward services as training,
sampled their own way (``--eval_temperature``, ``--eval_n_samples_per_prompt``; the rest as
training: top-p, top-k, the length limit), and are never trained on: they are collected apart
from the step's prompts (lockstep: between steps; async: through the feed, tagged and counted
apart, ``learner.controller.feed.OffPolicyFeed.add_eval``). Rank 0 only; the schedule decides
when (``Schedule.evaluate``), the driver writes the metrics.

When (``eval_due``): at the start of a fresh run (step 0: the untrained policy), every
``--eval_steps`` steps, and at the last step; ``--eval_steps -1`` is the start and the end only.
The evaluation at step s measures the weights pushed as version s.

What (``eval_metrics``), per data source ``S`` (``--eval_datasource_key``) with n samples per
prompt and a sample passing when its reward is above ``--eval_pass_threshold`` tau:

    eval/S/pass@1            = mean over S's samples of [r > tau]       (each prompt weighs the same: n each)
    eval/S/pass@n            = mean over S's prompts of [max_j r_j > tau]  (n > 1 only)
    eval/S/reward            = mean reward
    eval/S/response_length   = mean response tokens (an agent's: the policy's, feedback not counted)
    eval/S/truncated_frac    = share of samples cut at --generate_max_len (finish reason "length";
                               an agent episode: cut by --max_len or --agent_max_turns)
    eval/S/turns             = mean actions per episode (agent runs only)

and over every source ``eval/accuracy`` (pass@1 of all samples: what launch.local's progress
line and the demo read), ``eval/pass@n``, ``eval/reward``, ``eval/response_length``,
``eval/truncated_frac``, with ``eval/prompts`` and ``eval/failed_groups`` (prompts whose scoring
failed: left out of every mean). OpenRLHF's pass1 and pass{n} are the mean and the max of the
rewards; for 0/1 rewards they are these with tau in [0, 1).

Best checkpoint (``--best_metric_key``): ``EvalHistory`` keeps every evaluation's value of the
key (default ``eval/accuracy``; OpenRLHF's ``eval_<source>_pass<k>`` names are read as
``eval/<source>/pass@<k>``); a checkpoint is ranked by the evaluation at its own step
(``learner.runtime.checkpoint_policy.retained``). Higher is better, as in OpenRLHF.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from common.protocol import SamplingParams
from learner.controller.types import CollectResult, PromptItem, ScoredSample

DEFAULT_BEST_KEY = "eval/accuracy"
_OPENRLHF_KEY = re.compile(r"^eval_(.+)_pass(\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.@-]+")


def eval_due(step: int, total_steps: int, eval_steps: int) -> bool:
    """Whether the run evaluates after ``step`` (step 0: before the first; a resumed run does
    not redo the evaluation of the step it resumed from, which the killed run did before saving)."""
    if step == 0 or step == total_steps:
        return True
    return eval_steps > 0 and step % eval_steps == 0


def metric_name(source: str) -> str:
    """A data source as it appears in a metric's key (``eval/<name>/pass@1``)."""
    return _UNSAFE.sub("_", source).strip("_") or "default"


def eval_metrics(
    groups: Sequence[tuple[str, Sequence[ScoredSample]]], *, threshold: float, failed_groups: int = 0
) -> dict[str, float]:
    """The metrics above from ``(data source, the prompt's n scored samples)`` pairs."""
    by_source: dict[str, list[Sequence[ScoredSample]]] = {}
    for source, samples in groups:
        if samples:
            by_source.setdefault(metric_name(source), []).append(samples)
    out: dict[str, float] = {}
    every: list[Sequence[ScoredSample]] = []
    for name in sorted(by_source):
        out.update(_summary(f"eval/{name}", by_source[name], threshold))
        every += by_source[name]
    overall = _summary("eval", every, threshold)
    overall["eval/accuracy"] = overall.pop("eval/pass@1", math.nan)
    out.update(overall)
    out["eval/failed_groups"] = float(failed_groups)
    return out


def _summary(prefix: str, groups: Sequence[Sequence[ScoredSample]], threshold: float) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    if not samples:
        return {f"{prefix}/prompts": 0.0}
    n = max(len(g) for g in groups)
    out = {
        f"{prefix}/pass@1": sum(s.reward > threshold for s in samples) / len(samples),
        f"{prefix}/reward": sum(s.reward for s in samples) / len(samples),
        # the policy's tokens: an agent's environment feedback is not its answer's length
        f"{prefix}/response_length": sum(s.action_len for s in samples) / len(samples),
        f"{prefix}/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        f"{prefix}/prompts": float(len(groups)),
    }
    if any(s.turns for s in samples):
        out[f"{prefix}/turns"] = sum(s.turns for s in samples) / len(samples)
    if n > 1:
        out[f"{prefix}/pass@{n}"] = sum(any(s.reward > threshold for s in g) for g in groups) / len(groups)
    return out


class Evaluator:
    """The evaluation prompts and how they are sampled and measured (rank 0).

    ``items`` carry their data source (``PromptItem.source``); ``sampling`` is the evaluation's
    own; ``seed`` (``--seed_sampling``): every evaluation samples prompt i with the same seed,
    so that the curve compares the policies on the same draws (its points differ by the policy,
    not by the sampling noise)."""

    def __init__(
        self, items: Sequence[PromptItem], sampling: SamplingParams, *, threshold: float, seed: int | None = None
    ) -> None:
        from learner.rl.prompts import sampling_seed

        if seed is not None:
            items = [dataclasses.replace(it, seed=sampling_seed(seed, "eval", i)) for i, it in enumerate(items)]
        self.items = list(items)
        self.sampling = sampling
        self.threshold = threshold

    def measure(self, result: CollectResult) -> dict[str, float]:
        """The metrics of one evaluation's collect (its kept groups, in the order of ``result.entries``)."""
        n = result.rollout.group_size
        groups = [(e.payload.source, result.rollout.samples[i * n : (i + 1) * n]) for i, e in enumerate(result.entries)]
        metrics = eval_metrics(groups, threshold=self.threshold, failed_groups=result.failed_groups)
        if result.rollout.samples:  # the weights that answered: the version pushed before the evaluation
            metrics["eval/policy_version"] = float(min(s.policy_version for s in result.rollout.samples))
        return metrics

    def samples(self, result: CollectResult, decode: Any, k: int) -> list[dict[str, Any]]:
        """A few of the evaluation's samples (one per prompt, the first ``k`` prompts) as rows
        of the samples log."""
        n = result.rollout.group_size
        picked = [(e.payload.source, result.rollout.samples[i * n]) for i, e in enumerate(result.entries[:k])]
        return sample_rows(picked, decode, split="eval")


def sample_rows(picked: Iterable[tuple[str, ScoredSample]], decode: Any, *, split: str) -> list[dict[str, Any]]:
    """Rows of the samples log (``MetricsWriter.write_samples``): prompt and response decoded."""
    picked = list(picked)
    if not picked:
        return []
    texts = decode([s.prompt for _, s in picked] + [s.response.tolist() for _, s in picked])
    prompts, responses = texts[: len(picked)], texts[len(picked) :]
    return [
        {
            "split": split,
            "source": source,
            "prompt": p,
            "response": r,
            "reward": s.reward,
            "finish_reason": s.finish_reason,
            "policy_version": s.policy_version,
        }
        for (source, s), p, r in zip(picked, prompts, responses, strict=True)
    ]


def best_metric_key(flag: str) -> str | None:
    """The metric ``--best_metric_key`` ranks checkpoints by (None: off)."""
    if flag == "none":
        return None
    if not flag:
        return DEFAULT_BEST_KEY
    m = _OPENRLHF_KEY.match(flag)
    return f"eval/{metric_name(m.group(1))}/pass@{m.group(2)}" if m else flag


class EvalHistory:
    """Every evaluation's value of the best-checkpoint metric, by step (rank 0; in checkpoints)."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.scores: dict[int, float] = {}
        self._checked = False

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """After the evaluation at ``step``. The first one checks the key names one of its metrics."""
        if self.key is None:
            return
        if self.key not in metrics:
            if not self._checked:
                raise ValueError(
                    f"--best_metric_key {self.key}: the evaluation has no such metric; it has "
                    f"{sorted(k for k in metrics if k.startswith('eval/'))}"
                )
            return
        self._checked = True
        value = float(metrics[self.key])
        if not math.isnan(value):
            self.scores[step] = value

    def state_dict(self) -> dict[str, Any]:
        return {"key": self.key, "scores": {str(k): v for k, v in self.scores.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("key") == self.key:  # scores of another metric do not rank this run's checkpoints
            self.scores = {int(k): float(v) for k, v in state.get("scores", {}).items()}
            self._checked = bool(self.scores)


def scores_in(run_state: Mapping[str, Any]) -> dict[int, float]:
    """The evaluation scores by step kept in a checkpoint's run state (``state.json``)."""
    saved = run_state.get("driver", {}).get("eval", {}).get("scores", {})
    return {int(k): float(v) for k, v in saved.items()}
