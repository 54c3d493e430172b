"""--packing_samples: each micro-batch as one packed row gives the padded layout's numbers.

* the row layout (``learner.algorithms.packing``), by hand;
* packed log-probs and entropies equal padded ones to 1e-5 in fp32 on the tiny model, with
  SDPA and eager attention (transformers builds a block-diagonal mask from position ids that
  restart per sample), for samples of different prompt and response lengths;
* a PolicyTrainer step on packed rows gives the gradients, old log-probs, losses and metrics
  of the padded step; so does the critic (old values, value-loss gradients);
* a model whose attention cannot keep packed samples apart is refused, naming why.

A gradient-recording ``GradEngine`` (tests/helpers/trainer_fakes.py) stands in for DeepSpeed
(``step`` does not update), so two trainers see the same weights and their accumulated
gradients can be compared. The packed path through DeepSpeed and real services:
tests/e2e/test_e2e_estimators.py (gae).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.algorithms.packing import packed_row, response_logit_index, unpack_to_padded
from learner.controller.types import Rollout, ScoredSample
from learner.rl.config import PPOConfig
from learner.rl.critic import Critic, load_critic, response_values
from learner.rl.experience import collate
from learner.rl.policy_trainer import PolicyTrainer, response_logprobs
from learner.runtime.models import check_packable

# ------------------------------------------------------------------ the row layout, by hand


def test_packed_row_restarts_positions_per_sample():
    ids, pos = packed_row([[5, 6, 7], [8], [9, 10]])
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert pos.tolist() == [[0, 1, 2, 0, 0, 1]]


def test_response_logit_index_points_at_the_token_before_each_response_token():
    # Sample 0: prompt (a b) response (c d e) at columns 0-4: c is predicted at column 1 (b),
    # d at 2, e at 3. Sample 1: prompt (f) response (g) at columns 5-6: g predicted at 5.
    # Sample 2: prompt (h i j), no response, columns 7-9: nothing.
    # Sample 3: prompt (k) response (l m) at columns 10-12: 10, 11.
    assert response_logit_index([2, 1, 3, 1], [3, 1, 0, 2]).tolist() == [1, 2, 3, 5, 10, 11]
    with pytest.raises(ValueError, match="non-empty prompt"):
        response_logit_index([0], [1])


def test_unpack_to_padded_fills_rows_in_order_and_passes_gradients():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], requires_grad=True)
    out = unpack_to_padded(flat, mask)
    assert out.tolist() == [[1, 2, 0], [0, 0, 0], [3, 4, 5]]
    (out * torch.arange(9.0).reshape(3, 3)).sum().backward()
    assert flat.grad.tolist() == [0, 1, 6, 7, 8]  # the weight at each value's padded position
    with pytest.raises(ValueError, match="5 packed values for a mask of 4"):
        unpack_to_padded(flat, mask & (torch.arange(3) < 2))


# ------------------------------------------------------------------ the tiny model


def _model(model_dir, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)


def _rollout(n: int = 8, ref: bool = False, empty: bool = False) -> Rollout:
    """Samples of different prompt (1-5) and response (1-6) lengths; ``empty``: one response of 0."""
    samples = []
    for i in range(n):
        prompt = [5 + i % 3, 6, 7, 11, 13][: 1 + (i * 3) % 5]
        response = [8 + i, 9, 10, 12, 14, 15][: 1 + (i * 5) % 6]
        if empty and i == 3:
            response = []
        lp = -0.1 * torch.arange(1, len(response) + 1, dtype=torch.float32)  # "vLLM's" log-probs
        response = torch.tensor(response, dtype=torch.int32)  # token ids, as the controller gives them
        samples.append(ScoredSample(i // 2, i % 2, prompt, response, lp, lp - 0.05 if ref else None, float(i % 3)))
    return Rollout(samples, group_size=2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_and_entropy_equal_padded(tiny_model_dir, attn):
    model = _model(tiny_model_dir, attn).eval()
    samples = _rollout(empty=True).samples
    padded, packed = collate(samples, 0), collate(samples, 0, packed=True)
    L = sum(len(s.prompt) + len(s.response) for s in samples)
    assert packed["input_ids"].shape == (1, L) and "attention_mask" not in packed
    assert L < padded["input_ids"].numel()  # the padding is gone
    mask = padded["action_mask"]
    assert torch.equal(packed["action_mask"], mask) and torch.equal(packed["response"], padded["response"])
    for response_only in (True, False):  # logits at response columns only, or all then indexed
        with torch.no_grad():
            want, want_ent = response_logprobs(model, padded, 0.7, with_entropy=True, response_only=response_only)
            got, got_ent = response_logprobs(model, packed, 0.7, with_entropy=True, response_only=response_only)
        assert got.shape == want.shape
        torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(got_ent[mask], want_ent[mask], rtol=0, atol=1e-5)
        assert (got[~mask] == 0).all() and (got_ent[~mask] == 0).all()
    # The comparison has teeth: the same row with positions running on (one long sequence)
    # attends across samples and gives other numbers.
    crossing = dict(packed, position_ids=torch.arange(L)[None])
    with torch.no_grad():
        wrong, _ = response_logprobs(model, crossing, 0.7)
    assert (wrong[mask] - want[mask]).abs().max() > 1e-2


# ------------------------------------------------------------------ a trainer step


def _cfg(model_dir, **kw) -> PPOConfig:
    return small_ppo_config(model_dir, **{"generate_max_len": 6, **kw})


def _assert_same_grads(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """To 1e-5, relative to each tensor's largest gradient when that exceeds 1 (k3's KL loss
    against reference log-probs far from the model's gives gradients of ~170)."""
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, float(b.abs().max())))
    assert any(g.abs().max() > 0 for g in got)


def _step(model_dir, packed: bool, on_policy: bool, rollout: Rollout, **kw):
    cfg = _cfg(model_dir, packing_samples=packed, **kw)
    accum = cfg.train.batch_size // cfg.train.micro_batch_size
    critic = None
    if cfg.algo.advantage.estimator == "gae":
        torch.manual_seed(0)
        critic = Critic(
            GradEngine(load_critic(str(model_dir)), accum),
            pad_id=0,
            device=torch.device("cpu"),
            micro_rollout_batch_size=cfg.rollout.micro_batch_size,
            value_clip=cfg.critic.value_clip,
        )
    engine = GradEngine(_model(model_dir), accum)
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu"), critic=critic)
    result = trainer.step(rollout, on_policy=on_policy)
    return engine, critic, result.metrics, result


@pytest.mark.parametrize(
    "on_policy, kw",
    [
        (True, {}),  # old log-probs taken from the (packed) training forward
        (False, dict(is_correction="tis", entropy_loss_coef=0.01)),  # the (packed) old-log-probs forward runs
        (False, dict(use_kl_loss=True, init_kl_coef=0.1, kl_estimator="k3")),
        (True, dict(init_kl_coef=0.05)),  # KL in the reward: old log-probs needed before training
        (False, dict(policy_loss_type="gspo", loss_agg_mode="seq_mean_token_mean", max_epochs=2)),
    ],
)
def test_a_packed_step_gives_the_padded_steps_gradients_and_metrics(tiny_model_dir, on_policy, kw):
    ref = "init_kl_coef" in kw
    padded, _, m_pad, t_pad = _step(tiny_model_dir, False, on_policy, _rollout(ref=ref), **kw)
    packed, _, m_pack, t_pack = _step(tiny_model_dir, True, on_policy, _rollout(ref=ref), **kw)
    assert m_pack.keys() == m_pad.keys()
    assert m_pack["policy/old_logprobs_reused"] == m_pad["policy/old_logprobs_reused"]
    _assert_same_grads(packed.grads(), padded.grads())
    mask = collate(_rollout().samples, 0)["action_mask"]
    torch.testing.assert_close(t_pack.old_logprobs[mask], t_pad.old_logprobs[mask], rtol=0, atol=1e-5)
    for k, v in m_pad.items():  # losses, ratios, clip fractions, KL, entropy, lengths: per token, unchanged
        assert m_pack[k] == pytest.approx(v, rel=1e-6, abs=1e-5), k


def test_critic_values_and_updates_are_the_same_packed(tiny_model_dir):
    rollout = _rollout(ref=True)
    kw = dict(advantage_estimator="gae", n_samples_per_prompt=1, rollout_batch_size=8, lambd=0.95)
    pol_pad, critic_pad, m_pad, _ = _step(tiny_model_dir, False, True, rollout, **kw)
    pol_pack, critic_pack, m_pack, _ = _step(tiny_model_dir, True, True, rollout, **kw)
    # Old values (no grad, micro-batches of 4): packed rows equal padded ones.
    mask = collate(rollout.samples, 0)["action_mask"]
    v_pad, v_pack = critic_pad.values(rollout), critic_pack.values(rollout, packed=True)
    torch.testing.assert_close(v_pack[mask], v_pad[mask], rtol=0, atol=1e-5)
    assert (v_pack[~mask] == 0).all()
    with torch.no_grad():
        one = response_values(critic_pad.engine, collate(rollout.samples, 0, packed=True))  # all 8 in one row
    torch.testing.assert_close(one[mask], v_pad[mask], rtol=0, atol=1e-5)
    # The value-loss gradients and the policy's (GAE advantages from those values).
    _assert_same_grads(critic_pack.engine.grads(), critic_pad.engine.grads())
    _assert_same_grads(pol_pack.grads(), pol_pad.grads())
    for k, v in m_pad.items():
        assert m_pack[k] == pytest.approx(v, abs=1e-5), k
    assert m_pack["critic/value_loss"] > 0


# ------------------------------------------------------------------ refusals


class _OwnMaskModel(torch.nn.Module):
    """Stands for a model whose code builds its own attention mask (not transformers.masking_utils)."""

    def __init__(self, attn: str) -> None:
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation=attn)


def test_models_that_cannot_keep_packed_samples_apart_are_refused(tiny_model_dir):
    check_packable(GradEngine(_model(tiny_model_dir), 1), "policy")  # Qwen2 with SDPA: fine
    check_packable(GradEngine(load_critic(str(tiny_model_dir)), 1), "critic")  # through ValueModel.hf_model
    with pytest.raises(ValueError, match="policy model uses attention implementation 'flex_attention'"):
        check_packable(_OwnMaskModel("flex_attention"), "policy")
    with pytest.raises(ValueError, match="does not build its attention mask with transformers.masking_utils"):
        check_packable(_OwnMaskModel("sdpa"), "critic")
    # The trainer checks at construction, before any step.
    cfg = _cfg(tiny_model_dir, packing_samples=True)
    with pytest.raises(ValueError, match="--packing_samples"):
        PolicyTrainer(GradEngine(_OwnMaskModel("sdpa"), 1), cfg, pad_id=0, device=torch.device("cpu"))


def test_sft_refuses_packing_for_such_a_model_before_building_its_engine(monkeypatch):
    """learner.train_sft --packing_samples makes the same check, right after loading the model."""
    from common.config import build
    from learner.supervised import sft_trainer
    from learner.train_sft import SFTConfig

    cfg = build(SFTConfig, pretrain="m", dataset="d", input_key="input", output_key="output", packing_samples=True)
    tok = SimpleNamespace(pad_token_id=0)
    monkeypatch.setattr(sft_trainer, "setup_run", lambda cfg, name: (SimpleNamespace(world_size=1), tok))
    monkeypatch.setattr(sft_trainer, "load_samples", lambda cfg, keys, encode: ([], None))
    monkeypatch.setattr(sft_trainer.E, "load_causal_lm", lambda *a, **k: _OwnMaskModel("sdpa"))

    def no_engine(*a, **k):
        raise AssertionError("the engine was built before the check")

    monkeypatch.setattr(sft_trainer, "make_train_engine", no_engine)
    with pytest.raises(ValueError, match="--packing_samples: the SFT model's code"):
        sft_trainer.run(cfg)


def test_the_flag_parses_as_in_openrlhf():
    from common.config import parse

    cfg = parse(
        PPOConfig,
        ["--pretrain", "m", "--prompt_data", "p", "--advantage_estimator", "reinforce", "--packing_samples"],
        prog="learner.train_ppo",
    )
    assert cfg.ds.packing_samples
