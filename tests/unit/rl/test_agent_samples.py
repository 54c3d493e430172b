"""Agent episodes in the learner: the action mask decides what trains.

An episode's response interleaves the policy's actions with the environment's feedback (mask 0):
feedback is context for later actions and nothing else. Checked on the real policy trainer
(``GradEngine`` from tests/helpers/trainer_fakes.py in DeepSpeed's place), padded and packed:
changing what the environment tokens carry (their recorded log-probs, a trailing feedback
token after the last action) leaves the loss, the gradients and every metric unchanged; the
scalar reward sits on the last action token even when the episode ends on the environment's
turn; lengths count actions only (no false overlong penalty); the mask survives the
broadcast to the other ranks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.algorithms.kl import kl_penalized_rewards
from learner.controller.types import Rollout, ScoredSample
from learner.rl.experience import _pack, _unpack, collate
from learner.rl.policy_trainer import PolicyTrainer

# response: action, feedback, feedback, action, action, feedback (the episode ends on feedback)
MASK = [True, False, False, True, True, False]


def _rollout(junk: float = 0.0, tail: int = 21) -> Rollout:
    """8 episodes; ``junk`` is written where the environment's tokens' log-probs are (vLLM's and
    the reference's; neither means anything there), ``tail`` is the last feedback token."""
    samples = []
    for i in range(8):
        prompt = [5 + i % 3, 6, 7][: 1 + i % 3]
        response = [8 + i, 17, 18, 9 + i % 2, 10, tail]
        mask = torch.tensor(MASK)
        lp = -0.1 * torch.arange(1, 7, dtype=torch.float32)
        lp = torch.where(mask, lp, torch.full_like(lp, junk))
        ref = torch.where(mask, lp - 0.05, torch.full_like(lp, 3 * junk))
        response = torch.tensor(response, dtype=torch.int32)  # token ids, as the controller gives them
        samples.append(ScoredSample(i // 2, i % 2, prompt, response, lp, ref, float(i % 3), action_mask=mask, turns=2))
    return Rollout(samples, group_size=2)


def _step(model_dir, rollout: Rollout, **kw):
    cfg = small_ppo_config(model_dir, generate_max_len=6, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = GradEngine(model, cfg.train.batch_size // cfg.train.micro_batch_size)
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu"))
    return engine, trainer.step(rollout, on_policy=False).metrics


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "kw",
    [
        dict(init_kl_coef=0.05, entropy_loss_coef=0.01, is_correction="tis"),  # KL in the reward
        dict(use_kl_loss=True, init_kl_coef=0.1, kl_estimator="k3", advantage_estimator="reinforce_baseline"),
    ],
)
def test_environment_tokens_carry_no_loss_and_no_gradient(tiny_model_dir, packed, kw):
    a, m_a = _step(tiny_model_dir, _rollout(), packing_samples=packed, **kw)
    b, m_b = _step(tiny_model_dir, _rollout(junk=-7.0, tail=33), packing_samples=packed, **kw)
    for x, y in zip(a.grads(), b.grads(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    assert any(g.abs().max() > 0 for g in a.grads())
    assert m_a.keys() == m_b.keys()
    for k, v in m_a.items():
        assert m_b[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    # Lengths and logprob_diff are over the policy's 3 tokens of 6.
    assert m_a["rollout/response_len"] == 3.0
    # The same rollout with the mask forgotten (all tokens the policy's) trains differently.
    plain = _rollout(junk=-7.0, tail=33)
    for s in plain.samples:
        s.action_mask = None
    c, _ = _step(tiny_model_dir, plain, packing_samples=packed, **kw)
    assert max((x - y).abs().max() for x, y in zip(a.grads(), c.grads(), strict=True)) > 1e-4


def test_the_reward_sits_on_the_last_action_token_when_the_environment_speaks_last():
    mask = torch.tensor([MASK])
    kl = torch.full((1, 6), 0.5)
    # by hand: R_t = -0.1 * 0.5 on action tokens, + 2.0 on the last action (index 4), 0 elsewhere
    want = torch.tensor([[-0.05, 0.0, 0.0, -0.05, 1.95, 0.0]])
    torch.testing.assert_close(kl_penalized_rewards(torch.tensor([2.0]), kl, mask, 0.1), want)


def test_overlong_penalty_counts_the_policys_tokens_only(tiny_model_dir):
    """6 response tokens, 3 of them the policy's; cap 6, buffer 3: the penalty starts past
    L_exp = 3 tokens, so 3 actions cost nothing (r' = r - min(max(3 - 3, 0), 3) / 3 = r), where
    all 6 tokens counted would cost the whole factor (r - 3 / 3)."""
    cfg = small_ppo_config(tiny_model_dir, generate_max_len=6, overlong_buffer_len=3, overlong_penalty_factor=1.0)
    trainer = PolicyTrainer(GradEngine(torch.nn.Linear(1, 1), 2), cfg, pad_id=0, device=torch.device("cpu"))
    rollout = _rollout()
    torch.testing.assert_close(trainer.shaped_rewards(rollout), rollout.rewards())
    for s in rollout.samples:
        s.action_mask = None
    torch.testing.assert_close(trainer.shaped_rewards(rollout), rollout.rewards() - 1.0)


def test_masks_and_turns_survive_the_broadcast_to_other_ranks():
    rollout = _rollout()
    rollout.samples[1].action_mask = None  # a plain sample beside them
    rollout.samples[1].turns = 0
    back = _unpack(_pack(rollout), 2)
    for s, t in zip(rollout.samples, back.samples, strict=True):
        assert t.turns == s.turns and t.response.tolist() == s.response.tolist() and t.prompt == s.prompt
        assert (t.action_mask is None) == (s.action_mask is None)
        if s.action_mask is not None:
            assert torch.equal(t.action_mask, s.action_mask)
    batch = collate(back.samples, 0)
    assert batch["action_mask"][0].tolist() == MASK and batch["action_mask"][1].all()


def test_agent_metrics_count_turns_environment_tokens_failures_and_prefix_hits():
    from types import SimpleNamespace

    from learner.rl.metrics import agent_metrics

    peers = [SimpleNamespace(stats={"agent_later_turn_tokens": 300.0, "agent_later_turn_cached": 256.0}),
             SimpleNamespace(stats={"agent_later_turn_tokens": 100.0, "agent_later_turn_cached": 0.0})]  # fmt: skip
    controller = SimpleNamespace(
        counters={"failed_episodes": 2}, pool=SimpleNamespace(alive=lambda role: peers if role == "rollout" else [])
    )
    m = agent_metrics(controller, _rollout().samples)  # 2 turns, 3 environment tokens of 6 each
    assert m == {
        "agent/turns": 2.0,
        "agent/env_tokens": 3.0,
        "agent/failed_episodes": 2,
        "agent/prefix_cache_hit": 256 / 400,
    }
    plain = _rollout().samples
    for s in plain:
        s.action_mask, s.turns = None, 0
    assert agent_metrics(controller, plain) == {}
