"""``rollout/logprob_diff`` is the health metric: learner vs vLLM log-probs over the samples of
the weights being trained (lag 0) only; ``rollout/logprob_diff_all`` is the same over every
sample, lag included (the async schedule's samples of older weights differ by the policy's own
change, 0.2-0.5 on the tiny model, which says nothing about the weight sync)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.controller.types import Rollout, ScoredSample
from learner.rl.experience import collate
from learner.rl.policy_trainer import PolicyTrainer, logprob_diff_metrics

JUNK = 9.0  # written past each response: the mask must keep it out


def _sample(version: int, n: int) -> ScoredSample:
    return ScoredSample(0, 0, [1], torch.full((n,), 5), torch.zeros(n), None, 0.0, policy_version=version)


def test_the_health_metric_counts_lag_0_tokens_only():
    # Three samples, the learner trains version 4; sample 1 was started by version 3 (lag 1).
    rollout = Rollout([_sample(4, 2), _sample(3, 3), _sample(4, 1)], group_size=1)
    old = torch.tensor([[-1.0, -2.0, JUNK], [-1.0, -1.0, -1.0], [-0.5, JUNK, JUNK]])  # (N, T) learner
    vllm = torch.tensor([[-1.5, -2.0, 0.0], [-2.0, -2.0, -3.0], [-0.25, 0.0, 0.0]])  # (N, T) sampler
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    # |old - vllm| on real tokens: sample 0 [0.5, 0], sample 1 [1, 1, 2], sample 2 [0.25]
    # lag 0 (samples 0 and 2): (0.5 + 0 + 0.25) / 3 tokens = 0.25
    # all: (0.75 + 4) / 6 tokens = 4.75 / 6
    got = logprob_diff_metrics(old, vllm, mask, rollout, version=4)
    assert got == pytest.approx({"rollout/logprob_diff": 0.25, "rollout/logprob_diff_all": 4.75 / 6})
    # no version known: every sample counts as lag 0 (both figures are the same)
    assert logprob_diff_metrics(old, vllm, mask, rollout, version=None) == pytest.approx(
        {"rollout/logprob_diff": 4.75 / 6, "rollout/logprob_diff_all": 4.75 / 6}
    )
    # a step with no sample of the trained weights has no health figure, not a misleading one
    assert logprob_diff_metrics(old, vllm, mask, rollout, version=5) == pytest.approx(
        {"rollout/logprob_diff_all": 4.75 / 6}
    )


def test_the_trainer_takes_the_health_metric_over_the_samples_of_the_version_it_is_told(tiny_model_dir):
    """Through a real step: half the samples are of the trained version 7 and half of version 6;
    the figure is the lag-0 half's mean |old - vLLM| on the step's own old log-probs."""
    samples = []
    for i in range(8):
        response = torch.tensor([8 + i, 9, 10, 12][: 1 + i % 4], dtype=torch.int32)
        lp = -0.1 * torch.arange(1, len(response) + 1, dtype=torch.float32)  # "vLLM's" log-probs
        samples.append(ScoredSample(i // 2, i % 2, [5, 6], response, lp, None, float(i % 3), policy_version=7 - i % 2))
    rollout = Rollout(samples, group_size=2)
    cfg = small_ppo_config(tiny_model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = PolicyTrainer(GradEngine(model, 2), cfg, pad_id=0, device=torch.device("cpu"))
    result = trainer.step(rollout, on_policy=False, version=7)
    full = collate(rollout.samples, 0)
    diff = (result.old_logprobs - full["rollout_logprobs"]).abs()
    tokens = [diff[i, : len(s.response)] for i, s in enumerate(samples)]
    lag0 = torch.cat(tokens[0::2])
    assert result.metrics["rollout/logprob_diff"] == pytest.approx(float(lag0.mean()), rel=1e-6)
    assert result.metrics["rollout/logprob_diff_all"] == pytest.approx(float(torch.cat(tokens).mean()), rel=1e-6)
    assert result.metrics["rollout/logprob_diff"] != pytest.approx(result.metrics["rollout/logprob_diff_all"])
