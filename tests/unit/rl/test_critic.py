"""The critic of PPO-with-GAE in-process: a plain torch optimizer stands in for DeepSpeed.

The value model is the real one (tiny Qwen2 with a fresh score head); ``FakeEngine`` has
DeepSpeed's engine surface (backward divides by grad-accum, step steps at the boundary).
The DeepSpeed path itself runs in tests/e2e/test_e2e_estimators.py.
"""

from __future__ import annotations

import torch

from common.config import build
from learner.controller.types import Rollout, ScoredSample
from learner.rl.config import PPOConfig
from learner.rl.critic import Critic, load_critic, response_values
from learner.rl.experience import collate


class FakeEngine(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, lr: float, accum: int = 1) -> None:
        super().__init__()
        self.module = model
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.accum, self.calls = accum, 0

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum).backward()  # DeepSpeed's mean over accumulation steps

    def step(self) -> None:
        self.calls += 1
        if self.calls % self.accum == 0:
            self.opt.step()
            self.opt.zero_grad()

    def gradient_accumulation_steps(self) -> int:
        return self.accum


def _rollout(rewards=(1.0, 0.0, 1.0, 0.0)) -> Rollout:
    samples = []
    for i, r in enumerate(rewards):
        prompt = [5, 6, 7][: 2 + i % 2]  # ragged prompts: left padding matters
        response = [8 + i, 9, 10][: 1 + i % 3]  # ragged responses: right padding matters
        response = torch.tensor(response, dtype=torch.int32)  # token ids, as the controller gives them
        samples.append(ScoredSample(i, 0, prompt, response, torch.zeros(len(response)), None, r))
    return Rollout(samples, group_size=1)


def _cfg(model_dir, **kw) -> PPOConfig:
    base = dict(
        pretrain=str(model_dir),
        prompt_data="p",
        advantage_estimator="gae",
        n_samples_per_prompt=1,
        rollout_batch_size=4,
        train_batch_size=4,
        micro_train_batch_size=2,
        micro_rollout_batch_size=2,
        init_kl_coef=0.0,
        generate_max_len=8,
        critic_learning_rate=1e-2,
        actor_learning_rate=1e-3,
    )
    return build(PPOConfig, **{**base, **kw})


def test_values_are_read_where_the_logits_are_and_padding_does_not_change_them(tiny_model_dir):
    torch.manual_seed(0)
    model = load_critic(str(tiny_model_dir)).eval()
    ro = _rollout()
    with torch.no_grad():
        together = response_values(model, collate(ro.samples, 0))  # (4, T), padded batch
        for i, s in enumerate(ro.samples):
            alone = response_values(model, collate([s], 0))  # (1, T_i), no padding
            # V_t is at the hidden state of the last prompt token + t: the state before action t.
            ids = torch.tensor([s.prompt + s.response.tolist()])
            every = model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
            P = len(s.prompt)
            assert torch.allclose(alone, every[:, P - 1 : P - 1 + len(s.response)], atol=1e-5)
            assert torch.allclose(together[i, : len(s.response)], alone[0], atol=1e-4)
    # A fresh head starts small, N(0, 1/(H+1)): first values are near 0.
    assert together.abs().max() < 5


def test_critic_alone_fits_the_returns(tiny_model_dir):
    torch.manual_seed(0)
    critic = Critic(
        FakeEngine(load_critic(str(tiny_model_dir)), lr=1e-2, accum=2),
        pad_id=0,
        device=torch.device("cpu"),
        micro_rollout_batch_size=3,
        value_clip=None,
    )
    ro = _rollout()
    full = collate(ro.samples, 0)
    returns = ro.rewards()[:, None].expand_as(full["action_mask"]).float() * full["action_mask"]
    from learner.rl.critic import token_mean_spec

    losses = []
    for _ in range(15):
        old = critic.values(ro)  # (4, T)
        agg = token_mean_spec(full["action_mask"])
        step_losses = []
        with critic.optimizer_step() as step:
            for idx in ([0, 1], [2, 3]):  # two micro-batches, one optimizer step
                b = collate([ro.samples[i] for i in idx], 0)
                T = b["response"].shape[1]
                m = critic.train_micro_batch(b, old[idx, :T], returns[idx, :T], agg, world=1, step=step)
                step_losses.append(m["value_loss"])
        losses.append(sum(step_losses) / 2)
    assert losses[-1] < 0.2 * losses[0], losses


def test_value_clip_flag_semantics(tiny_model_dir):
    """--value_clip c > 0 clips (learner.algorithms.losses.value_loss, tested by hand there); <= 0 is off."""
    critic = Critic(None, pad_id=0, device=torch.device("cpu"), micro_rollout_batch_size=4, value_clip=0.5)
    assert critic.value_clip == 0.5
    assert (
        Critic(None, pad_id=0, device=torch.device("cpu"), micro_rollout_batch_size=1, value_clip=0.0).value_clip
        is None
    )  # <= 0: off


def test_ppo_step_with_critic_freezes_the_actor_then_trains_both(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from learner.rl.policy_trainer import PolicyTrainer

    torch.manual_seed(0)
    cfg = _cfg(tiny_model_dir, freezing_actor_steps=0, value_clip=0.5)  # step 0 is the critic's (OpenRLHF's count)
    # train batch 4, micro-batches of 2 on one rank: DeepSpeed would accumulate 2
    policy = FakeEngine(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), lr=1e-3, accum=2)
    critic_engine = FakeEngine(load_critic(str(tiny_model_dir)), lr=1e-2, accum=2)
    critic = Critic(critic_engine, pad_id=0, device=torch.device("cpu"), micro_rollout_batch_size=2, value_clip=0.5)
    trainer = PolicyTrainer(policy, cfg, pad_id=0, device=torch.device("cpu"), critic=critic)
    ro = _rollout()
    snap = lambda m: [p.detach().clone() for p in m.parameters()]
    changed = lambda a, m: any(not torch.equal(x, y) for x, y in zip(a, m.parameters(), strict=True))

    p0, c0 = snap(policy), snap(critic_engine)
    m1 = trainer.step(ro).metrics
    assert not changed(p0, policy), "the actor must be frozen during --freezing_actor_steps"
    assert changed(c0, critic_engine)
    assert m1["policy/actor_updated"] == 0.0 and not any(k.startswith("policy/loss") for k in m1)
    for k in ("critic/value_loss", "critic/values_mean", "critic/returns_mean", "critic/value_clip_frac"):
        assert torch.isfinite(torch.tensor(m1[k])), (k, m1)
    # gamma = lambd = 1, no KL: the GAE return of every token is the sequence reward, so the
    # token-weighted mean return is sum_i r_i n_i / sum_i n_i = (1*1 + 0*2 + 1*3 + 0*1) / 7.
    lens = [len(s.response) for s in ro.samples]
    assert lens == [1, 2, 3, 1]
    assert abs(m1["policy/return_mean"] - 4 / 7) < 1e-5

    p1, c1 = snap(policy), snap(critic_engine)
    m2 = trainer.step(ro).metrics
    assert changed(p1, policy) and changed(c1, critic_engine)
    assert m2["policy/actor_updated"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in m2.values() if isinstance(v, float))


def test_trainer_refuses_a_missing_or_stray_critic(tiny_model_dir):
    import pytest

    from learner.rl.policy_trainer import PolicyTrainer

    with pytest.raises(ValueError, match="critic is needed exactly when"):
        PolicyTrainer(None, _cfg(tiny_model_dir), pad_id=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="critic is needed exactly when"):
        PolicyTrainer(
            None,
            _cfg(tiny_model_dir, advantage_estimator="reinforce"),
            pad_id=0,
            device=torch.device("cpu"),
            critic=object(),
        )


# --- the value head's name (--ds.value_head_prefix) and --normalize_reward -----------------------


def _rm_with_head(rm_dir, out, name: str, **config):
    """``rm_dir``'s reward model with its head saved as ``name``.weight and ``config`` added."""
    import json

    from safetensors.torch import load_file, save_file

    out.mkdir()
    sd = load_file(rm_dir / "model.safetensors")
    head = sd.pop("score.weight")
    sd[f"{name}.weight"] = head
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((rm_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **config}))
    return out, head


def _raw_values(model, ids):
    return model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])  # (1, L)


def test_the_value_head_is_the_tensor_value_head_prefix_names(tiny_model_dir, tmp_path):
    from helpers.reward_models import build_tiny_rm

    rm = build_tiny_rm(tiny_model_dir, tmp_path / "rm")
    named, head = _rm_with_head(rm, tmp_path / "named", "my_head", architectures=["RewardModel"])
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = _raw_values(load_critic(str(rm)), ids)  # the same head under transformers' name
        got = load_critic(str(named), value_head_prefix="my_head")
        assert torch.equal(got.hf_model.score.weight, head)
        torch.testing.assert_close(_raw_values(got, ids), want, rtol=0, atol=1e-6)
        # By its default (score) the checkpoint has no head: a fresh, small one.
        fresh = load_critic(str(named))
        assert not torch.equal(fresh.hf_model.score.weight, head) and _raw_values(fresh, ids).abs().max() < 5
    # A name the config records wins over the flag (OpenRLHF's rule; our RM trainer writes it).
    recorded, _ = _rm_with_head(rm, tmp_path / "recorded", "value_head", value_head_prefix="value_head")
    assert torch.equal(load_critic(str(recorded)).hf_model.score.weight, head)


def test_a_saved_critic_keeps_its_heads_name_and_says_it(tiny_model_dir, tmp_path):
    import json

    from safetensors.torch import load_file

    from helpers.reward_models import build_tiny_rm
    from learner.runtime.engine import save_hf

    named, head = _rm_with_head(build_tiny_rm(tiny_model_dir, tmp_path / "rm"), tmp_path / "n", "my_head")
    save_hf(load_critic(str(named), value_head_prefix="my_head"), None, tmp_path / "saved")  # as --save_value_network
    sd = load_file(tmp_path / "saved" / "model.safetensors")
    assert torch.equal(sd["my_head.weight"], head) and "score.weight" not in sd
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["value_head_prefix"] == "my_head"
    # ... so that it loads back by the config alone, whatever the flag says.
    assert torch.equal(load_critic(str(tmp_path / "saved")).hf_model.score.weight, head)


def test_normalize_reward_normalises_the_critics_values_by_its_configs_statistics(tiny_model_dir, tmp_path):
    """OpenRLHF's critic with --normalize_reward: V = (head - mean) / std, mean/std from the
    critic's config (a reward model's); without them, the head's values as they are."""
    from helpers.reward_models import build_tiny_rm

    rm = build_tiny_rm(tiny_model_dir, tmp_path / "rm")
    with_stats, _ = _rm_with_head(rm, tmp_path / "stats", "score", mean=0.5, std=[2.0])
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        raw = _raw_values(load_critic(str(with_stats)), ids)
        normed = _raw_values(load_critic(str(with_stats), normalize=True), ids)
        torch.testing.assert_close(normed, (raw - 0.5) / 2.0, rtol=0, atol=1e-6)
        plain = load_critic(str(rm), normalize=True)  # an HF classifier's config has no mean/std
        assert (plain.mean, plain.std) == (0.0, 1.0)
        torch.testing.assert_close(_raw_values(plain, ids), raw, rtol=0, atol=0)
    bad, _ = _rm_with_head(rm, tmp_path / "bad", "score", mean=0.5, std=0.0)
    import pytest

    with pytest.raises(ValueError, match="std=0.0, must be > 0"):
        load_critic(str(bad), normalize=True)
