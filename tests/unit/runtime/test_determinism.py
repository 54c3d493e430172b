"""``--train.full_determinism_enable`` (learner.runtime.determinism): the seeds, the switches,
and two runs of two PPO steps that end bit-identical.

The runs are learner processes of one rank (a subprocess each: the switches are process-wide)
that set up as ``learner.train_ppo`` does (``init_process``, ``build_trainer``: real DeepSpeed
ZeRO-2 engines for the policy and the critic) and train two steps of PPO with GAE on a rollout
whose rewards come from the seeded generator. On a CUDA host they run on the GPU, where the
switches matter (an embedding's backward adds with atomics unless told not to).

Worker: ``python tests/unit/runtime/test_determinism.py MODEL_DIR SEED`` prints ``RESULT {...}``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.runtime.determinism import seed_everything

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def restore_determinism(monkeypatch):
    """The switches are process-wide: put them back after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def test_seed_everything_seeds_every_generator_and_full_determinism_sets_the_switches(restore_determinism):
    import numpy as np

    seed_everything(7)
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    seed_everything(7, full_determinism=True)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"


def test_the_flag_is_no_longer_inert():
    from common.config import build
    from learner.rl.config import PPOConfig

    cfg = build(PPOConfig, pretrain="m", prompt_data="p", full_determinism=True)
    assert cfg.train.full_determinism_enable and not any("full_determinism" in n for n in cfg.notices)


def worker(model_dir: str, seed: int) -> None:
    import hashlib

    from transformers import AutoTokenizer

    from common.config import build
    from learner.controller.types import Rollout, ScoredSample
    from learner.rl.config import PPOConfig
    from learner.rl.run import Data, build_trainer, init_process

    cfg = build(
        PPOConfig,
        pretrain=model_dir,
        prompt_data="p",
        advantage_estimator="gae",
        n_samples_per_prompt=1,
        rollout_batch_size=8,
        train_batch_size=8,
        micro_train_batch_size=2,  # 4 micro-batches accumulated per optimizer step
        micro_rollout_batch_size=4,
        generate_max_len=8,
        init_kl_coef=0.0,
        zero_stage=2,
        actor_learning_rate=1e-3,
        critic_learning_rate=1e-3,
        seed=seed,
        full_determinism=True,
    )
    proc = init_process(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    models = build_trainer(cfg, proc, Data(tokenizer, 0, [], [], 8, 1, 2))
    rewards = torch.rand(8)  # from the generator --seed seeded: the runs agree only if it did
    samples = []
    for i in range(8):
        response = torch.tensor([8 + i, 9, 10, 11, 12][: 1 + i % 5], dtype=torch.int32)
        lp = -torch.rand(len(response))  # "vLLM's" log-probs (only logged; the step is on-policy)
        samples.append(ScoredSample(i, 0, [5 + i % 3, 6, 7][: 2 + i % 2], response, lp, None, float(rewards[i])))
    rollout = Rollout(samples, group_size=1)
    metrics = [models.trainer.step(rollout).metrics for _ in range(2)]
    digest = {}
    for part, engine in (("policy", models.engine), ("critic", models.critic.engine)):
        h = hashlib.sha256()
        for p in engine.module.parameters():
            h.update(p.detach().float().cpu().numpy().tobytes())
        digest[part] = h.hexdigest()
    print(
        "RESULT "
        + json.dumps(
            {
                "device": proc.device.type,
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                "digest": digest,
                "metrics": metrics,
            }
        ),
        flush=True,
    )


def _run(model_dir, seed: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUBLAS_WORKSPACE_CONFIG"):
        env.pop(k, None)
    cmd = [sys.executable, __file__, str(model_dir), str(seed)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln[len("RESULT ") :] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[0])


@pytest.mark.slow
def test_two_runs_of_two_steps_with_full_determinism_are_bit_identical(tiny_model_dir):
    first, second = _run(tiny_model_dir, 0), _run(tiny_model_dir, 0)
    assert first["deterministic"] and first["cublas"] == ":16:8"
    # Both steps updated the policy and the critic (metrics of both), and everything is equal:
    # every parameter bit for bit, every metric exactly.
    assert [m["policy/actor_updated"] for m in first["metrics"]] == [1.0, 1.0]
    assert first["metrics"][0]["critic/value_loss"] > 0
    assert first["digest"] == second["digest"] and first["metrics"] == second["metrics"]
    # ... and it is the seed that fixes them: another --seed, other rewards, other weights.
    assert _run(tiny_model_dir, 1)["digest"]["policy"] != first["digest"]["policy"]


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
