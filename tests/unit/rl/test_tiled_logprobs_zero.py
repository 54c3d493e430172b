"""--ds.logits_tile_tokens on real DeepSpeed engines: the policy's gradient of one PolicyTrainer
step (old log-probs, the policy loss with the entropy in it) is the whole logits' at ZeRO-1, 2 and
3 (the head's weight gathered by ZeRO-3's hooks at each tile's call, in forward and in backward's
recompute; gradient checkpointing on at ZeRO-3), a world of one over gloo, in a subprocess.

The gradients are read as DeepSpeed holds them, between the step's backward and its optimizer
step (``deepspeed.utils.safe_get_full_grad``), so that Adam's first step, which moves every weight
by about lr whatever its gradient's size, does not hide or invent differences.

Worker: ``python tests/unit/rl/test_tiled_logprobs_zero.py MODEL_DIR`` prints ``RESULT {...}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TILE = 5


def worker(model_dir: str) -> None:
    import torch
    from deepspeed.utils import safe_get_full_grad

    from common.config import build
    from learner.controller.types import Rollout, ScoredSample
    from learner.rl.config import PPOConfig
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.runtime import engine as E

    info = E.init_distributed()
    samples = []
    for i in range(8):
        prompt = [5 + i % 3, 6, 7][: 1 + i % 3]
        response = torch.tensor([8 + i, 9, 10, 11, 12, 13][: 1 + (i * 5) % 6], dtype=torch.int32)
        lp = -0.1 * torch.arange(1, len(response) + 1, dtype=torch.float32)
        samples.append(ScoredSample(i // 2, i % 2, prompt, response, lp, None, float(i % 3)))
    rollout = Rollout(samples, group_size=2)
    results: dict[str, float] = {}
    for stage in (1, 2, 3):
        grads = {}
        for tile in (0, TILE):
            cfg = build(
                PPOConfig,
                pretrain=model_dir,
                prompt_data="p",
                advantage_estimator="group_norm",
                n_samples_per_prompt=2,
                rollout_batch_size=4,
                train_batch_size=8,
                micro_train_batch_size=4,
                micro_rollout_batch_size=4,
                generate_max_len=6,
                init_kl_coef=0.0,
                entropy_loss_coef=0.01,
                zero_stage=stage,
                logits_tile_tokens=tile,
                seed=0,
            )
            torch.manual_seed(0)
            model = E.load_causal_lm(model_dir, zero_stage=stage, gradient_checkpointing=stage == 3)
            engine = E.make_engine(
                model,
                zero_stage=stage,
                bf16=False,
                train_batch_size=8,
                micro_train_batch_size=4,
                learning_rate=1e-3,
                num_training_steps=10,
                lr_scheduler="constant_with_warmup",
                lr_warmup_ratio=0.0,
            )
            seen: dict[str, torch.Tensor] = {}
            step = engine.step

            def read_then_step(step=step, engine=engine, seen=seen) -> None:
                for name, p in engine.module.named_parameters():
                    g = safe_get_full_grad(p)
                    seen[name] = seen.get(name, 0) + (g.detach().clone() if g is not None else 0)
                step()

            engine.step = read_then_step
            PolicyTrainer(engine, cfg, pad_id=0, device=info.device).step(rollout, on_policy=False)
            grads[tile] = seen
        whole, tiled = grads[0], grads[TILE]
        assert whole.keys() == tiled.keys() and whole
        # The largest difference relative to each tensor's largest gradient.
        results[f"zero{stage}"] = max(
            float((tiled[k] - whole[k]).abs().max()) / max(1e-12, float(whole[k].abs().max())) for k in whole
        )
        results[f"zero{stage}_largest"] = max(float(g.abs().max()) for g in whole.values())
    print("RESULT " + json.dumps(results), flush=True)


@pytest.mark.slow
def test_tiled_gradients_equal_whole_logits_at_every_zero_stage(tiny_model_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny_model_dir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [ln[len("RESULT ") :] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = json.loads(lines[0])
    for stage in (1, 2, 3):
        assert results[f"zero{stage}_largest"] > 0, results
        assert results[f"zero{stage}"] < 1e-5, results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    worker(sys.argv[1])
