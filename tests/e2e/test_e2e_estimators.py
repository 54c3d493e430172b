"""End to end: estimators other than GRPO through launch.local with real vLLM, the reward
service and DeepSpeed (slow; the run joins the session's shared fleet).

* PPO with a critic (``--advantage_estimator gae``): the critic trains — its value loss
  falls — on the first-char-parity reward a tiny random model learns in a few steps. It runs
  with ``--packing_samples`` (every learner forward on packed rows: the critic's old values,
  the critic and policy training forwards), and the learner's packed log-probs agree with
  vLLM's (``rollout/logprob_diff``), which they would not if attention crossed samples.
* The critic-free estimators run through the real services in the other e2e runs, each with
  loss options that run nowhere else end to end: GRPO (group_norm) in test_e2e_grpo.py and the
  async runs, RLOO with dynamic filtering, GSPO and TIS in the async dynamic-filtering run,
  Dr. GRPO with clip-higher and dual clip in the killed-server run. Every estimator and loss
  option also runs in-process on a real DeepSpeed engine in tests/unit/rl/test_estimators_step.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.e2e_launch import finish, local_cmd, metrics, start

pytestmark = pytest.mark.slow


def _launch(tmp_path: Path, model: Path, fleet, *, steps: int, extra_learner: list[str] = ()):
    from launch.demo_task import problems, write_jsonl

    train, _ = problems(0)
    prompts = write_jsonl(train, tmp_path / "prompts.jsonl")
    learner = [
        *("--prompt_data", str(prompts), "--input_key", "input", "--n_samples_per_prompt", "8"),
        *("--rollout_batch_size", "16", "--train_batch_size", "128", "--micro_train_batch_size", "128"),
        *("--micro_rollout_batch_size", "128", "--max_steps", str(steps), "--generate_max_len", "4"),
        *("--actor_learning_rate", "3e-3", "--init_kl_coef", "0", "--zero_stage", "2", "--seed", "0"),
        *("--peer_timeout_s", "5", *extra_learner),
    ]
    proc = start(local_cmd(tmp_path / "run", model, learner, fleet=fleet))
    out = finish(proc, 600)
    assert proc.returncode == 0, out[-4000:]
    rows = [m for m in metrics(tmp_path / "run") if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, steps + 1)), out[-4000:]
    return rows


def test_ppo_with_critic_trains_the_critic(tmp_path, tiny_model_dir, shared_fleet):
    steps = 6
    rows = _launch(
        tmp_path,
        tiny_model_dir,
        shared_fleet,
        steps=steps,
        extra_learner=[
            "--advantage_estimator",
            "gae",
            "--critic_learning_rate",
            "1e-3",
            "--value_clip",
            "0.5",
            "--gamma",
            "1",
            "--lambd",
            "0.95",
            "--save_value_network",
            "--packing_samples",
        ],
    )
    # fp32 on both sides: ~1e-6 when each sample attends only to itself (padded runs show the same)
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in rows), [m["rollout/logprob_diff"] for m in rows]
    losses = [m["critic/value_loss"] for m in rows]
    # A fresh value head starts near 0 against rewards in {0, 1}; the critic learns the mean
    # and then the policy's rising reward shrinks the variance left to explain.
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    assert all(m["policy/actor_updated"] == 1.0 for m in rows)
    assert all(abs(m["critic/values_mean"]) < 10 for m in rows)
    # --save_value_network: the trained critic is written next to the policy, head included.
    import torch
    from transformers import AutoModelForSequenceClassification

    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "model_critic", num_labels=1)
    assert saved.config.architectures[0].endswith("ForSequenceClassification")
    fresh = torch.randn(saved.score.weight.shape, generator=torch.Generator().manual_seed(0)) / (
        saved.config.hidden_size + 1
    )  # the head the critic started from (learner.runtime.models)
    assert not torch.allclose(saved.score.weight, fresh), "the saved head is the untrained one"
