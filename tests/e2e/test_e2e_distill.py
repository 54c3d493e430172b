"""End to end: on-policy distillation through launch.local with real vLLM, the reward service
and DeepSpeed (slow; the run joins the session's shared fleet and swaps only its reward service,
a few seconds, no engine: the teacher is served by the reward service's HF backend).

The teacher is the tiny model with every weight matrix perturbed (``build_perturbed_teacher``,
made here): same tokenizer, next-token distributions ~1.9 nats of reverse KL away from the
student's. Pure distillation: no reward source (the service serves the teacher alone, rewards
0), GRPO's group advantage is 0 and the advantage is the teacher's per-token term (centred).
Checked: the exact reverse KL, over the whole vocabulary, at the first response position of the
training prompts, falls between the student before the run and the model it saved (measured
1.826 -> 1.649 in 8 steps; 134 s alone, the fleet's start included); the learner logs its sampled
estimate every step.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from helpers.e2e_launch import PARITY_REWARD, finish, local_cmd, metrics, start
from helpers.teacher_models import build_perturbed_teacher

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture
def fleet_reward(_fleet):
    """The shared fleet's reward service swapped for this run's; the fleet's own put back after."""
    yield _fleet.use_reward
    _fleet.use_reward(PARITY_REWARD)


def exact_reverse_kl(student: Path, teacher: Path, prompts: list[str]) -> float:
    """Mean over prompts of KL[student || teacher] of the first response token, over the vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student)
    s = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    t = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
            q, m = s(ids).logits[0, -1].log_softmax(-1), t(ids).logits[0, -1].log_softmax(-1)
            total += float((q.exp() * (q - m)).sum())
    return total / len(prompts)


def test_pure_distillation_lowers_the_reverse_kl_to_the_teacher(tmp_path, tiny_model_dir, shared_fleet, fleet_reward):
    from common.config import parse
    from launch.demo_task import problems, write_jsonl
    from launch.local import _reward_flags_from_learner
    from learner.rl.config import PPOConfig

    teacher = build_perturbed_teacher(tiny_model_dir, tmp_path / "teacher", scale=1.0)
    train, _ = problems(0)
    train = train[:64]
    prompts = write_jsonl(train, tmp_path / "prompts.jsonl")
    learner = [
        *("--prompt_data", str(prompts), "--input_key", "input", "--n_samples_per_prompt", "4"),
        *("--rollout_batch_size", "16", "--train_batch_size", "64", "--micro_train_batch_size", "64"),
        *("--micro_rollout_batch_size", "64", "--max_steps", str(STEPS), "--generate_max_len", "4"),
        *("--actor_learning_rate", "3e-3", "--init_kl_coef", "0", "--zero_stage", "2", "--seed", "0"),
        *("--advantage_estimator", "group_norm", "--teacher_pretrain", str(teacher), "--distill_coef", "1"),
        *("--num_episodes", "2", "--peer_timeout_s", "5"),
    ]
    # the reward service launch.local would start for these flags: the teacher alone
    cfg = parse(PPOConfig, ["--pretrain", str(tiny_model_dir), *learner], raise_errors=True)
    reward = shlex.join(_reward_flags_from_learner(cfg))
    assert "--teacher_pretrain" in reward and "--reward_func" not in reward and "--ref_pretrain" not in reward
    fleet_reward(reward)
    run = tmp_path / "run"
    proc = start(local_cmd(run, tiny_model_dir, learner, reward=reward, fleet=shared_fleet))
    out = finish(proc, 600)
    log = (run / "logs" / "learner.log").read_text() if (run / "logs" / "learner.log").exists() else ""
    assert proc.returncode == 0, out[-3000:] + log[-5000:]
    rows = [m for m in metrics(run) if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1)), out[-4000:]
    assert all(m["rollout/reward"] == 0 for m in rows)  # no reward source: the teacher's term alone
    kl = [m["distill/reverse_kl"] for m in rows]
    before = exact_reverse_kl(tiny_model_dir, teacher, [r["input"] for r in train])
    after = exact_reverse_kl(run / "model", teacher, [r["input"] for r in train])
    print("distill/reverse_kl by step:", [round(x, 3) for x in kl])
    print(f"exact KL[student || teacher] at the first response token: {before:.3f} -> {after:.3f}")
    # The logged estimate is a mean over one step's 256 sampled tokens, ~0.1 of noise from step to
    # step (measured: 1.83 1.89 1.72 1.89 1.65 1.58 1.86 1.93 in a run whose exact KL fell 0.90x):
    # sane and finite here; the exact measure, free of sampling noise, is what must fall.
    assert all(0 < x < 10 for x in kl), kl
    assert after < 0.95 * before, (before, after)
