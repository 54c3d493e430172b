"""The run's Scoring alone (learner/controller/scoring.py): which prompts a reward service sees,
and how its answer and the episodes' own rewards are merged, by hand on two episodes."""

from __future__ import annotations

import math

import pytest
import torch

from common import protocol as P
from learner.controller.scoring import AGENT_SCORER, EpisodeScoring, ServiceScoring


def episodes(rewards, scores=None) -> P.SampleBatch:
    n = len(rewards)
    return P.SampleBatch(
        prompt_ids=[4] * n,
        sample_indices=list(range(n)),
        response_lengths=[2] * n,
        response_ids=torch.arange(2 * n, dtype=torch.int32),
        prompt_token_ids=[[1]] * n,
        episodes=P.EpisodeOutputs(
            action_mask=torch.ones(2 * n, dtype=torch.uint8),
            rewards=rewards,
            scores=scores if scores is not None else list(rewards),
            logs=[{"tries": float(i)} for i in range(n)],
        ),
    )


def service_answer(rows: list[int]) -> P.ScoredBatch:
    """A reward service's answer in its own row order: reward 10 + index, score 20 + index."""
    return P.ScoredBatch(
        prompt_ids=[4] * len(rows),
        sample_indices=rows,
        rewards=torch.tensor([10.0 + i for i in rows]),
        scores=torch.tensor([20.0 + i for i in rows]),
        ref_logprobs=torch.zeros(2 * len(rows)),
        server="rw0",
    )


def test_plain_samples_always_go_to_the_service_and_keep_its_answer():
    s = ServiceScoring()
    b = episodes([1.0])
    assert s.route(b) is None and s.merge(b, ans := service_answer([0])) is ans


def test_episodes_with_their_rewards_and_no_reference_are_scored_here():
    scored = EpisodeScoring(reference=False, service_rewards=False).route(episodes([0.5, 1.0], [0.0, 1.0]))
    assert scored is not None and scored.server == AGENT_SCORER
    assert scored.rewards.tolist() == [0.5, 1.0] and scored.scores.tolist() == [0.0, 1.0]
    assert scored.extra_logs == {"tries": [0.0, 1.0]}
    with pytest.raises(ValueError, match="plain samples where agent episodes were asked"):
        EpisodeScoring(reference=False, service_rewards=False).route(
            P.SampleBatch(
                prompt_ids=[4], sample_indices=[0], response_lengths=[0], response_ids=torch.zeros(0, dtype=torch.int32)
            )
        )


def test_a_reference_or_a_none_sends_the_prompt_to_the_service():
    assert EpisodeScoring(reference=True, service_rewards=False).route(episodes([0.5, 1.0])) is None
    assert EpisodeScoring(reference=False, service_rewards=True).route(episodes([0.5, None])) is None
    failed = EpisodeScoring(reference=True, service_rewards=False).route(episodes([0.5, None]))
    assert failed is not None and all("pass --reward_pretrain or --remote_rm_url" in f for f in failed.failed)
    assert all(math.isnan(r) for r in failed.rewards.tolist())


def test_the_service_stands_only_where_an_episode_left_its_reward():
    # Episode 0: reward 0.5, score 0.25 (its own); episode 1: None, its score None -> the
    # service's reward 11 and score 21. The service answered rows in the order [1, 0].
    b = episodes([0.5, None], [0.25, None])
    merged = EpisodeScoring(reference=False, service_rewards=True).merge(b, service_answer([1, 0]))
    assert merged.sample_indices == [1, 0]
    assert merged.rewards.tolist() == [11.0, 0.5] and merged.scores.tolist() == [21.0, 0.25]
    assert merged.ref_logprobs is not None and merged.server == "rw0"


def test_a_teacher_sends_every_episode_to_the_service_and_its_log_probs_are_kept(tmp_path):
    """On-policy distillation with an agent: the teacher's log-probs come from a reward service,
    so episodes that scored themselves go there too (as for the reference), and the merge keeps
    the service's teacher log-probs beside the episodes' own rewards."""
    from common.config import build
    from learner.rl.build import sample_scoring
    from learner.rl.config import PPOConfig

    agent = tmp_path / "agent.py"
    agent.write_text("async def agent_func(client, prompt, label):\n    return {'reward': 1.0}\n")
    base = dict(pretrain="m", prompt_data="p", agent_func_path=str(agent), init_kl_coef=0.0)
    with_teacher = build(PPOConfig, **base, teacher_pretrain="t")
    scoring = sample_scoring(with_teacher)
    assert isinstance(scoring, EpisodeScoring) and scoring.reference
    assert with_teacher.services.min_reward_services == 1  # the teacher's services are waited for
    assert not sample_scoring(build(PPOConfig, **base)).reference  # no KL, no teacher: scored here
    assert scoring.route(episodes([0.5, 1.0])) is None
    answer = service_answer([1, 0])
    answer.teacher_logprobs = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    merged = scoring.merge(episodes([0.5, 1.0]), answer)
    assert merged.rewards.tolist() == [1.0, 0.5]  # the episodes' own
    assert torch.equal(merged.teacher_logprobs, answer.teacher_logprobs)
