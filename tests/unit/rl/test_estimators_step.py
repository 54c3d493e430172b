"""Every estimator and policy-loss option, one PolicyTrainer.step each, on a real DeepSpeed
engine (ZeRO-2, a world of one over gloo) in a subprocess: metrics are finite and the
parameters move. The end-to-end runs through real services are in test_e2e_estimators.py.

The rollout is built by hand (4 prompts x G = 2 samples, ragged lengths); its vLLM and
reference log-probs are the learner's own plus small noise, so the IS corrections keep
most tokens, as with a real engine.

Worker: ``python tests/unit/rl/test_estimators_step.py MODEL_DIR`` prints ``RESULT {...}``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CASES = {
    "reinforce": dict(advantage_estimator="reinforce", gamma=0.99, init_kl_coef=0.05),
    "reinforce_baseline": dict(advantage_estimator="reinforce_baseline", init_kl_coef=0.05, kl_estimator="k2"),
    "rloo": dict(advantage_estimator="rloo"),
    "group_norm": dict(advantage_estimator="group_norm"),
    "group_norm_no_std": dict(advantage_estimator="group_norm", no_advantage_std_norm=True),
    "dr_grpo": dict(advantage_estimator="dr_grpo", loss_agg_mode="seq_mean_token_sum_norm"),
    "gspo_tis": dict(advantage_estimator="group_norm", policy_loss_type="gspo", is_correction="tis", eps_clip=3e-3),
    "icepop_klloss_entropy_cliphigher_dualclip": dict(
        advantage_estimator="group_norm",
        is_correction="icepop",
        is_correction_low_high=[0.5, 2.0],
        use_kl_loss=True,
        kl_estimator="k3",
        init_kl_coef=0.01,
        entropy_loss_coef=0.01,
        eps_clip_low_high=[0.2, 0.28],
        dual_clip=3.0,
        kl_target=0.1,
        kl_horizon=100,
    ),
    "gae": dict(advantage_estimator="gae", gamma=1.0, lambd=0.95, critic_learning_rate=1e-3, value_clip=0.5),
    # on-policy distillation (the teacher's log-probs are stamped like the reference's): added to
    # GRPO's advantages, in GAE's token rewards
    "distill_group_norm": dict(advantage_estimator="group_norm", teacher_pretrain="teacher", distill_coef=0.5),
    "distill_gae": dict(
        advantage_estimator="gae", lambd=0.95, critic_learning_rate=1e-3, teacher_pretrain="teacher", init_kl_coef=0.01
    ),
}


def worker(model_dir: str) -> None:
    import torch

    from common.config import build
    from learner.controller.types import Rollout, ScoredSample
    from learner.rl.config import PPOConfig
    from learner.rl.critic import Critic, load_critic
    from learner.rl.experience import collate
    from learner.rl.policy_trainer import PolicyTrainer, response_logprobs
    from learner.runtime import engine as E
    from learner.runtime.accumulation import engine_coalesces

    info = E.init_distributed()
    torch.manual_seed(0)
    common = dict(
        pretrain=model_dir,
        prompt_data="p",
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        train_batch_size=8,
        # micro-batches of 2: one rank accumulates 4, two ranks 2 each, which at ZeRO-2 on CPU
        # reduce once per optimizer step (--coalesce_grad_reduction auto): checked against one rank
        micro_train_batch_size=2,
        micro_rollout_batch_size=4,
        generate_max_len=8,
        init_kl_coef=0.0,
        zero_stage=2,
        seed=0,
    )

    def engine_for(model, lr):
        return E.make_engine(
            model,
            zero_stage=2,
            bf16=False,
            train_batch_size=8,
            micro_train_batch_size=2,
            learning_rate=lr,
            num_training_steps=100,
            lr_scheduler="constant_with_warmup",
            lr_warmup_ratio=0.0,
        )

    policy = engine_for(E.load_causal_lm(model_dir, zero_stage=2), 1e-3)
    samples = []
    for i in range(8):
        prompt = [5 + i % 3, 6, 7][: 2 + i % 2]
        response = [8 + i, 9, 10, 11][: 1 + i % 4]
        response = torch.tensor(response, dtype=torch.int32)  # token ids, as the controller gives them
        samples.append(
            ScoredSample(
                i // 2, i % 2, prompt, response, torch.zeros(len(response)), None, reward=float((i * 7) % 3) / 2
            )
        )  # groups (0, .5), (1, 0), (.5, 1), (0, .5)
    gen = torch.Generator().manual_seed(1)

    def stamp() -> None:
        """vLLM and reference log-probs = the current policy's own + noise (the policy moves
        from case to case, and a real rollout is always from the current weights)."""
        with torch.no_grad():
            lp, _ = response_logprobs(policy, collate(samples, 0, info.device), 1.0)  # (8, T)
        for i, s in enumerate(samples):
            t = len(s.response)
            s.rollout_logprobs = lp[i, :t].float().cpu() + 0.05 * torch.randn(t, generator=gen)
            s.ref_logprobs = lp[i, :t].float().cpu() + 0.1 * torch.randn(t, generator=gen)
            s.teacher_logprobs = lp[i, :t].float().cpu() + 0.3 * torch.randn(t, generator=gen)

    rollout = Rollout(samples, group_size=2)

    results = {}
    for name, kw in CASES.items():
        cfg = build(PPOConfig, **{**common, **kw})
        critic = None
        if cfg.algo.advantage.estimator == "gae":
            critic_engine = engine_for(load_critic(model_dir, zero_stage=2), cfg.critic.adam.lr)
            critic = Critic(
                critic_engine,
                pad_id=0,
                device=info.device,
                micro_rollout_batch_size=4,
                value_clip=cfg.critic.value_clip,
                coalesce=engine_coalesces(critic_engine, cfg.ds.coalesce_grad_reduction),
            )
        trainer = PolicyTrainer(policy, cfg, pad_id=0, device=info.device, critic=critic)
        stamp()
        before = [p.detach().clone() for p in policy.module.parameters()]
        metrics = trainer.step(rollout).metrics
        moved = max(
            float((a - p.detach()).abs().max()) for a, p in zip(before, policy.module.parameters(), strict=True)
        )
        results[name] = {
            "finite": all(math.isfinite(v) for v in metrics.values() if isinstance(v, (int, float))),
            "moved": moved,
            "policy_loss": metrics.get("policy/policy_loss"),
            "value_loss": metrics.get("critic/value_loss"),
            "is_weight_mean": metrics.get("policy/is_weight_mean"),
            "kl_loss": metrics.get("policy/kl_loss"),
            "reverse_kl": metrics.get("distill/reverse_kl"),
            "old_logprobs_reused": metrics.get("policy/old_logprobs_reused"),
        }
    results["_coalesced"] = {"policy": trainer.coalesce, "critic": critic.coalesce}
    # Whole-batch equivalence across ranks: the weights after all the steps, summarised.
    results["_weights"] = {
        "policy": [float(p.detach().double().sum()) for p in policy.module.parameters()],
        "critic": [float(p.detach().double().sum()) for p in critic.engine.module.parameters()],
    }
    if info.rank == 0:  # one line: two ranks printing at once can interleave on the shared stdout
        print("RESULT " + json.dumps(results), flush=True)


def _run(model_dir, nproc: int = 1) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = (
        [sys.executable, __file__, str(model_dir)]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            __file__,
            str(model_dir),
        ]
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln[len("RESULT ") :] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[0])


@pytest.mark.slow
def test_every_estimator_and_loss_option_steps_a_deepspeed_engine(tiny_model_dir):
    results = _run(tiny_model_dir)
    results.pop("_weights")
    results.pop("_coalesced")
    assert set(results) == set(CASES)
    for name, r in results.items():
        assert r["finite"], (name, r)
        assert r["moved"] > 0, (name, r)  # the policy parameters changed
    assert results["gae"]["value_loss"] is not None and results["gae"]["value_loss"] > 0
    # Noise of 0.05 nats: IS weights near 1, icepop keeps nearly every token; the policy
    # loss of the first step is -mean(A) at ratio 1, nonzero for the un-whitened estimators.
    assert 0.9 < results["gspo_tis"]["is_weight_mean"] <= 1.1
    icepop = results["icepop_klloss_entropy_cliphigher_dualclip"]
    assert 0.9 < icepop["is_weight_mean"] <= 1.1 and 0 < icepop["kl_loss"] < 0.01
    assert results["rloo"]["policy_loss"] != 0
    # the teacher's term: measured (noise of 0.3 nats around the learner's own log-probs, so a
    # nonzero mean of log pi - log mu), and the old log-probs computed before training to build it
    for name in ("distill_group_norm", "distill_gae"):
        assert results[name]["reverse_kl"] is not None and results[name]["reverse_kl"] != 0, name
        assert results[name]["old_logprobs_reused"] == 0.0, name
    assert results["group_norm"]["reverse_kl"] is None  # no teacher, no term


@pytest.mark.slow
def test_two_ranks_end_with_the_weights_of_one(tiny_model_dir):
    """The same nine steps with the batch split over 2 gloo ranks (strided slices, global-count
    aggregation, loss x world, gradients reduced once per optimizer step) leave policy and
    critic where one rank leaves them."""
    import torch

    one, two = _run(tiny_model_dir), _run(tiny_model_dir, nproc=2)
    assert one["_coalesced"] == {"policy": False, "critic": False}  # one rank: nothing to coalesce
    assert two["_coalesced"] == {"policy": True, "critic": True}  # ZeRO-2 on CPU, 2 micro-batches a rank
    one, two = one["_weights"], two["_weights"]
    for part in ("policy", "critic"):
        a, b = torch.tensor(one[part]), torch.tensor(two[part])
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-3), (part, (a - b).abs().max())


if __name__ == "__main__":
    worker(sys.argv[1])
