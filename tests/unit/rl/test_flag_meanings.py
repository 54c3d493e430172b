"""train_ppo flags with OpenRLHF 0.10's meaning, checked where they act (issue 38):

* ``--reward.stop_properly_penalty_coef``: unset is off; >= 0 scales a truncated sample's
  reward, < 0 replaces it (OpenRLHF's ``apply_stop_properly_penalty``), before the clip;
* ``--critic.freezing_steps`` N: the policy is not updated while the 0-based step is <= N
  (OpenRLHF's ``global_steps > freezing_steps``): N + 1 critic-only steps, none for -1;
* ``--reward.normalize_enable``: the statistics saved with a model, never running ones (the
  critic's side: tests/unit/rl/test_critic.py; the reward service's:
  tests/unit/reward_service/test_reward_models.py), said when it can do nothing;
* ``--train.num_episodes``: passes over the prompts, the steps a run takes.
"""

from __future__ import annotations

import pytest
import torch

from common.config import build
from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.controller.types import Rollout, ScoredSample
from learner.rl.config import PPOConfig
from learner.rl.policy_trainer import PolicyTrainer


def _trainer(model_dir, **kw) -> PolicyTrainer:
    cfg = small_ppo_config(model_dir, **kw)
    critic = object() if cfg.needs_critic else None  # shaping and the freeze need no critic engine
    return PolicyTrainer(GradEngine(torch.nn.Linear(1, 1), 1), cfg, 0, torch.device("cpu"), critic=critic)


def _rollout(rewards, finish) -> Rollout:
    samples = [
        ScoredSample(i // 2, i % 2, [5, 6], torch.tensor([7, 8], dtype=torch.int32), torch.zeros(2), None, r)
        for i, r in enumerate(rewards)
    ]
    for s, f in zip(samples, finish, strict=True):
        s.finish_reason = f
    return Rollout(samples, group_size=2)


@pytest.mark.parametrize(
    "coef, want",
    [
        # rewards 1, 2, -0.5, 4; samples 1 and 3 were cut at the length limit
        (None, [1.0, 2.0, -0.5, 4.0]),  # unset: off (OpenRLHF's default None)
        (0.5, [1.0, 1.0, -0.5, 2.0]),  # >= 0 scales: 0.5 * 2 = 1, 0.5 * 4 = 2
        (0.0, [1.0, 0.0, -0.5, 0.0]),  # ProRL's 0: a truncated sample earns nothing
        (-0.5, [1.0, -0.5, -0.5, -0.5]),  # < 0 replaces: -0.5 whatever the reward was
        (-20.0, [1.0, -10.0, -0.5, -10.0]),  # replaced by -20, then clipped to --reward_clip_range's -10
    ],
)
def test_stop_properly_penalty_scales_or_replaces_truncated_rewards(tiny_model_dir, coef, want):
    trainer = _trainer(tiny_model_dir, stop_properly_penalty_coef=coef)
    rollout = _rollout([1.0, 2.0, -0.5, 4.0], ["stop", "length", "stop", "length"])
    assert trainer.shaped_rewards(rollout).tolist() == want


def test_stop_properly_penalty_defaults_off_and_refuses_a_scale_above_one(tiny_model_dir):
    assert small_ppo_config(tiny_model_dir).reward.stop_properly_penalty_coef is None
    assert small_ppo_config(tiny_model_dir, stop_properly_penalty_coef=1.0).reward.stop_properly_penalty_coef == 1.0
    with pytest.raises(ValueError, match="must be in"):
        small_ppo_config(tiny_model_dir, stop_properly_penalty_coef=1.01)


@pytest.mark.parametrize(
    "n, frozen",
    [
        (-1, []),  # OpenRLHF's default: never frozen
        (0, [0]),  # step 0: 0 > 0 is false, as in OpenRLHF
        (2, [0, 1, 2]),  # N + 1 critic-only steps
    ],
)
def test_freezing_steps_counts_as_openrlhf(tiny_model_dir, n, frozen):
    trainer = _trainer(tiny_model_dir, advantage_estimator="gae", n_samples_per_prompt=2, freezing_actor_steps=n)
    got = []
    for step in range(5):
        trainer.steps_done = step  # the 0-based steps trained so far, as a resumed checkpoint sets it
        if not trainer.actor_updates():
            got.append(step)
    assert got == frozen


def test_freezing_steps_default_is_openrlhfs_and_needs_a_critic(tiny_model_dir):
    assert small_ppo_config(tiny_model_dir).critic.freezing_steps == -1
    assert small_ppo_config(tiny_model_dir, advantage_estimator="gae", freezing_actor_steps=0).needs_critic
    with pytest.raises(ValueError, match="only with --advantage_estimator gae"):
        small_ppo_config(tiny_model_dir, freezing_actor_steps=0)


def test_normalize_reward_says_what_it_can_act_on():
    base = dict(pretrain="m", prompt_data="p", rollout_batch_size=8, train_batch_size=8)
    rule = build(PPOConfig, **base, advantage_estimator="group_norm", n_samples_per_prompt=2, normalize_reward=True)
    assert any("without a critic it does nothing" in n for n in rule.notices)
    gae = build(PPOConfig, **base, normalize_reward=True)  # a critic from the policy: a causal LM
    assert any("acts only if the critic's config (m) carries" in n for n in gae.notices)
    rm = build(PPOConfig, **base, normalize_reward=True, reward_pretrain="rm")
    assert not any("normalize_reward" in n for n in rm.notices)
    assert rm.reward.normalize_enable and "not running statistics" in " ".join(gae.notices)


def test_num_episodes_multiplies_the_steps_of_one_pass(tiny_model_dir, tmp_path):
    """``load_data``: 10 prompts in batches of 4 give 2 steps a pass (the rest is dropped, as
    every pass draws the same slices), so 3 episodes are 6 steps; --max_steps cuts them."""
    import json

    from learner.rl.run import Process, load_data

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(10)))
    proc = Process(0, 1, torch.device("cpu"))
    base = dict(
        pretrain=str(tiny_model_dir),
        prompt_data=str(data),
        advantage_estimator="group_norm",
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        train_batch_size=8,
    )
    got = load_data(build(PPOConfig, **base, num_episodes=3), proc)
    assert (got.n_prompts, got.steps_per_episode, got.total_steps) == (10, 2, 6)
    assert load_data(build(PPOConfig, **base, num_episodes=3, max_steps=5), proc).total_steps == 5
    assert load_data(build(PPOConfig, **base), proc).total_steps == 2  # OpenRLHF's default: one pass
