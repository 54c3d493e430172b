"""--train.enable_ema in train_ppo: the flags in both spellings, the policy's moving average
updated once per optimizer step of the policy (not per micro-batch, not per RL step) while the
trained weights stay what is trained and pushed, and the final save: the average in
--ckpt.output_dir, where OpenRLHF writes it, the trained policy in OUTPUT_DIR_trained.
The average itself: tests/unit/runtime/test_ema.py; in checkpoints: test_checkpoint.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import build, parse
from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.controller.types import Rollout, ScoredSample
from learner.rl.config import PPOConfig
from learner.rl.policy_trainer import PolicyTrainer
from learner.runtime.ema import EMA

BASE = ["--pretrain", "m", "--prompt_data", "p"]


def test_both_spellings_and_beta_checked():
    flat = parse(PPOConfig, [*BASE, "--enable_ema", "--ema_beta", "0.9"], raise_errors=True)
    dotted = parse(PPOConfig, [*BASE, "--train.enable_ema", "--train.ema_beta", "0.9"], raise_errors=True)
    for c in (flat, dotted):
        assert c.train.enable_ema and c.train.ema_beta == 0.9
        assert not any("ema" in n for n in c.notices)  # built: no longer "accepted, cannot act here"
    assert build(PPOConfig, pretrain="m", prompt_data="p").train.ema_beta == 0.992  # OpenRLHF's default
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match=r"--ema_beta must be in \(0, 1\)"):
            build(PPOConfig, pretrain="m", prompt_data="p", enable_ema=True, ema_beta=bad)


class SteppingEngine(GradEngine):
    """GradEngine whose optimizer step (DeepSpeed's: at the accumulation boundary, the last of
    ``accum`` ``step()`` calls) adds 1 to every trained weight."""

    def __init__(self, model: torch.nn.Module, accum: int) -> None:
        super().__init__(model, accum)
        self.calls = 0

    def step(self) -> None:
        self.calls += 1
        if self.calls % self.accum == 0:
            with torch.no_grad():
                for p in self.module.parameters():
                    p.add_(1.0)
                    p.grad = None


def _rollout(n: int = 8) -> Rollout:
    samples = []
    for i in range(n):
        response = torch.tensor([8 + i, 9, 10][: 1 + i % 3], dtype=torch.int32)
        lp = -0.1 * torch.ones(len(response))
        samples.append(ScoredSample(i // 2, i % 2, [5, 6, 7][: 2 + i % 2], response, lp, None, float(i % 3)))
    return Rollout(samples, group_size=2)


def test_the_average_follows_each_optimizer_step_and_the_trained_weights_stay_trained(tiny_model_dir):
    """8 samples, train batches of 4 in micro-batches of 2: two optimizer steps per RL step, each
    of two micro-batches. With beta = 1/2 and the weights w, w + 1, w + 2:
    ema = 1/2 (1/2 w + 1/2 (w + 1)) + 1/2 (w + 2) = w + 5/4, and the engine holds w + 2."""
    cfg = small_ppo_config(tiny_model_dir, train_batch_size=4, micro_train_batch_size=2, enable_ema=True, ema_beta=0.5)
    torch.manual_seed(0)
    engine = SteppingEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), accum=2)
    start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu"))
    assert trainer.ema is not None and trainer.ema.beta == 0.5
    trainer.step(_rollout(), on_policy=True)
    assert engine.calls == 4 and trainer.ema.updates == 2  # per optimizer step, not per micro-batch
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), start[name] + 1 + 1), name  # what is trained (and pushed)
        torch.testing.assert_close(trainer.ema.shards[name], (start[name] + 1.25).reshape(-1), rtol=0, atol=1e-6)
    no_ema = PolicyTrainer(engine, small_ppo_config(tiny_model_dir), pad_id=0, device=torch.device("cpu"))
    assert no_ema.ema is None


def test_save_final_writes_the_average_where_openrlhf_does_and_the_trained_policy_beside(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from learner.rl.build import trained_save_path
    from learner.rl.run import Models, Process, save_final

    out = tmp_path / "out"
    cfg = small_ppo_config(tiny_model_dir, enable_ema=True, ema_beta=0.5, save_path=str(out))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ema = EMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    ema.update()  # the average: w + 1/4; the model: w + 1/2
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_final(cfg, Models(model, None, SimpleNamespace(ema=ema)), None, Process(0, 1, torch.device("cpu")))
    assert trained_save_path(cfg.ckpt) == str(out) + "_trained"
    averaged = load_file(str(out / "model.safetensors"))
    policy = load_file(str(tmp_path / "out_trained" / "model.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
        assert torch.equal(policy[name], trained[name]), name
        assert torch.equal(averaged[name].reshape(-1), ema.shards[name]), name
