"""PolicyTrainer does no work the step does not need, and the result is the same.

* the old-log-probs forward is skipped exactly when its values would equal the training
  forward's (on-policy samples, one optimizer step, one epoch, no KL in the reward), and the
  loss, the gradient and ``rollout/logprob_diff`` are those of the step that runs it;
* logits only at response positions equal the full computation;
* full-vocabulary entropy is computed with grad only when it is in the loss, and as a metric
  only on logged steps.

A gradient-recording ``GradEngine`` (tests/helpers/trainer_fakes.py) stands in for DeepSpeed
(the DeepSpeed path runs in test_estimators_step.py and the e2e tests): ``step`` does not
update, so two trainers see the same weights and their accumulated gradients can be compared.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.controller.types import Rollout, ScoredSample
from learner.rl.experience import collate
from learner.rl.policy_trainer import PolicyTrainer, response_logprobs


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def _model(model_dir) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _rollout(n: int = 8, ref: bool = False) -> Rollout:
    samples = []
    for i in range(n):
        prompt = [5 + i % 3, 6, 7, 11][: 2 + i % 3]  # ragged prompts: left padding matters
        response = [8 + i, 9, 10, 12][: 1 + i % 4]  # ragged responses: right padding matters
        lp = -0.1 * torch.arange(1, len(response) + 1, dtype=torch.float32)  # "vLLM's" log-probs
        response = torch.tensor(response, dtype=torch.int32)  # token ids, as the controller gives them
        samples.append(ScoredSample(i // 2, i % 2, prompt, response, lp, lp - 0.05 if ref else None, float(i % 3)))
    return Rollout(samples, group_size=2)


def _step(model_dir, on_policy: bool, rollout: Rollout | None = None, **kw):
    cfg = small_ppo_config(model_dir, **kw)
    engine = GradEngine(_model(model_dir), accum=cfg.train.batch_size // cfg.train.micro_batch_size)
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu"))
    result = trainer.step(rollout or _rollout(), on_policy=on_policy)
    return engine, result.metrics, result


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(is_correction="tis", entropy_loss_coef=0.01),
        dict(use_kl_loss=True, init_kl_coef=0.1),  # KL as a loss: not needed before training
        dict(policy_loss_type="gspo", loss_agg_mode="seq_mean_token_mean"),
    ],
)
def test_skipping_old_logprobs_changes_nothing_when_on_policy(model_dir, kw):
    ref = kw.get("use_kl_loss", False)
    skip, m_skip, _ = _step(model_dir, True, _rollout(ref=ref), **kw)
    full, m_full, _ = _step(model_dir, False, _rollout(ref=ref), **kw)
    assert skip.forwards["no_grad"] == 0 and m_skip["policy/old_logprobs_reused"] == 1.0
    assert full.forwards["no_grad"] == 2 and m_full["policy/old_logprobs_reused"] == 0.0  # 8 samples / 4
    assert skip.forwards["grad"] == full.forwards["grad"] == 2
    for a, b in zip(skip.grads(), full.grads(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # The same losses and metrics; logprob_diff and the KL come from the training forward.
    for k in ("policy/policy_loss", "policy/ratio_mean", "rollout/logprob_diff", "policy/kl_to_ref"):
        # to float32 rounding: values near 7 are a few ulps (4.8e-7 each) apart between passes
        assert m_skip[k] == pytest.approx(m_full[k], rel=1e-6, abs=1e-6), k
    assert m_skip["policy/ratio_mean"] == 1.0  # exactly: log pi - stop_grad(log pi) = 0
    assert m_skip["rollout/logprob_diff"] > 0  # the "vLLM" log-probs differ from the model's


def test_logprob_diff_is_the_models_own(model_dir):
    rollout = _rollout()
    engine, metrics, result = _step(model_dir, True, rollout)
    with torch.no_grad():
        lp, _ = response_logprobs(engine.module, collate(rollout.samples, 0), 1.0, response_only=False)
    mask = collate(rollout.samples, 0)["action_mask"]
    # a training forward and a no-grad one agree to float32 rounding (a few ulps at |lp| ~ 7)
    torch.testing.assert_close(result.old_logprobs[mask], lp[mask], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "on_policy, kw, n",
    [
        (False, {}, 8),  # the schedule does not vouch for the samples (async: decoupled PPO)
        (True, dict(max_epochs=2), 8),  # the second epoch trains on moved weights
        (True, dict(rollout_batch_size=8), 16),  # two optimizer steps per rollout
        (True, dict(recompute_old_logprobs=True), 8),
        (True, dict(init_kl_coef=0.1), 8),  # KL in the reward: advantages need it before training
        (True, dict(freezing_actor_steps=1, advantage_estimator="gae"), 8),  # no actor forward to take them from
    ],
)
def test_old_logprobs_forward_runs_when_needed(model_dir, on_policy, kw, n):
    if kw.get("advantage_estimator") == "gae":
        cfg = small_ppo_config(model_dir, **kw)
        trainer = PolicyTrainer(GradEngine(_model(model_dir), 2), cfg, 0, torch.device("cpu"), critic=object())
        assert not trainer.reuses_logprobs(_rollout(), on_policy)
        return
    engine, metrics, _ = _step(model_dir, on_policy, _rollout(n, ref="init_kl_coef" in kw), **kw)
    assert metrics["policy/old_logprobs_reused"] == 0.0
    assert engine.forwards["no_grad"] == n // 4


def test_response_only_logits_equal_the_full_computation(model_dir):
    torch.manual_seed(0)
    model = _model(model_dir)
    batch = collate(_rollout().samples, 0)
    got, got_ent = response_logprobs(model, batch, 0.7, with_entropy=True)
    want, want_ent = response_logprobs(model, batch, 0.7, with_entropy=True, response_only=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=1e-6)
    g1 = torch.autograd.grad((got * batch["action_mask"]).sum(), list(model.parameters()))
    g2 = torch.autograd.grad((want * batch["action_mask"]).sum(), list(model.parameters()))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_entropy_only_when_in_the_loss_or_logged(model_dir):
    cfg = small_ppo_config(model_dir, logging_steps=2)
    trainer = PolicyTrainer(GradEngine(_model(model_dir), 2), cfg, 0, torch.device("cpu"))
    assert "policy/entropy" in trainer.step(_rollout(), on_policy=True).metrics  # step 1 of 2: logged
    assert "policy/entropy" not in trainer.step(_rollout(), on_policy=True).metrics
    # Without grad when not in the loss: the entropy metric has no graph.
    _, ent = response_logprobs(trainer.engine, collate(_rollout().samples, 0), 1.0, True, entropy_grad=False)
    assert not ent.requires_grad
    # In the loss: every step, and it moves the gradient.
    with_bonus, m, _ = _step(model_dir, True, entropy_loss_coef=0.5, logging_steps=2)
    without, _, _ = _step(model_dir, True, logging_steps=2)
    assert "policy/entropy" in m
    assert any(not torch.allclose(a, b) for a, b in zip(with_bonus.grads(), without.grads(), strict=True))
