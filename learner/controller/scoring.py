"""How a prompt's samples get their rewards: chosen once, when the run is built.

``learner/rl/build.py:sample_scoring`` picks one ``Scoring`` from the flags and hands it to the
controller, which asks it two things per generated prompt and never looks at what kind of run
it is in:

* ``route(samples)``: scored here (a ``ScoredBatch`` made from what the samples carry) or sent
  to a reward service (None);
* ``merge(samples, scored)``: a reward service's answer for them, as the ledger keeps it (so
  every later reader, ``scored_samples`` and the async feed, reads rewards from one place).

``ServiceScoring``: plain samples, every one scored by a reward service (model, function,
remote), which may also send the reference's log-probs.

``EpisodeScoring``: agent episodes (``--agent_func_path``), whose own reward is the reward. A
prompt goes to a reward service only when it must: for the reference's log-probs (KL on), or
for an episode that left its reward to the service (its executor returned ``reward: None``, as
OpenRLHF's do to have the reward model or function score the sample). The service's reward then
stands for those episodes only; the others keep their own. A teacher's log-probs (on-policy
distillation) send every prompt to a service, as the reference's do. A ``None`` in a run without a reward
model or function fails its group, naming the flags (counted and left out, as a failed score).
"""

from __future__ import annotations

import math

import torch

from common.protocol import SampleBatch, ScoredBatch

AGENT_SCORER = "agent"  # the "reward service" of episodes scored by their own agent


class Scoring:
    """The base: every prompt to a reward service, its answer kept as it is."""

    def route(self, samples: SampleBatch) -> ScoredBatch | None:
        """``samples`` (one prompt's) scored here, or None: a reward service scores them.
        Raises ValueError for samples of another kind than the run asked for."""
        return None

    def merge(self, samples: SampleBatch, scored: ScoredBatch) -> ScoredBatch:
        """A reward service's ``scored`` (rows of ``samples``' prompt) as the ledger keeps it."""
        return scored


class ServiceScoring(Scoring):
    """Plain samples: scored by a reward service."""


class EpisodeScoring(Scoring):
    def __init__(self, *, reference: bool, service_rewards: bool) -> None:
        """``reference``: the reward services send reference or teacher log-probs (KL on, or
        on-policy distillation), so every prompt goes to one; ``service_rewards``: the run has a reward model or function
        (``--reward_pretrain``, ``--remote_rm_url``) that can score an episode's None."""
        self.reference, self.service_rewards = reference, service_rewards

    def route(self, samples: SampleBatch) -> ScoredBatch | None:
        ep = samples.episodes
        if ep is None:
            raise ValueError("plain samples where agent episodes were asked")
        unscored = sum(r is None for r in ep.rewards)
        if unscored and not self.service_rewards:
            n = len(samples)
            why = (
                f"{unscored} episode(s) returned reward None (left to a reward model or function), but this run has "
                "none: pass --reward_pretrain or --remote_rm_url, or have the agent return a number"
            )
            return ScoredBatch(
                prompt_ids=list(samples.prompt_ids),
                sample_indices=list(samples.sample_indices),
                rewards=torch.full((n,), float("nan")),
                failed=[why] * n,
                server=AGENT_SCORER,
            )
        if unscored or self.reference:
            return None
        names = sorted({k for logs in ep.logs for k in logs})
        return ScoredBatch(
            prompt_ids=list(samples.prompt_ids),
            sample_indices=list(samples.sample_indices),
            rewards=torch.tensor(ep.rewards, dtype=torch.float32),
            scores=torch.tensor(
                [r if s is None else s for r, s in zip(ep.rewards, ep.scores or ep.rewards, strict=True)],
                dtype=torch.float32,
            ),
            extra_logs={k: [float(logs.get(k, math.nan)) for logs in ep.logs] for k in names},
            server=AGENT_SCORER,
        )

    def merge(self, samples: SampleBatch, scored: ScoredBatch) -> ScoredBatch:
        """The episodes' own rewards and scores over the service's, row by row; the service's
        stand where an episode left them (None). Reference log-probs and failures: the service's."""
        ep = samples.episodes
        if ep is None:
            return scored
        row = {idx: i for i, idx in enumerate(samples.sample_indices)}
        rewards = scored.rewards.float().clone()
        scores = (scored.scores if scored.scores is not None else scored.rewards).float().clone()
        for j, idx in enumerate(scored.sample_indices):
            i = row[idx]
            own, score = ep.rewards[i], ep.scores[i] if ep.scores else None
            if own is not None:
                rewards[j] = own
                scores[j] = own if score is None else score
            elif score is not None:
                scores[j] = score
        return ScoredBatch(
            prompt_ids=scored.prompt_ids,
            sample_indices=scored.sample_indices,
            rewards=rewards,
            ref_logprobs=scored.ref_logprobs,
            failed=scored.failed,
            scores=scores,
            extra_logs=scored.extra_logs,
            server=scored.server,
            teacher_logprobs=scored.teacher_logprobs,
            teacher_topk_ids=scored.teacher_topk_ids,
            teacher_topk_logprobs=scored.teacher_topk_logprobs,
        )
