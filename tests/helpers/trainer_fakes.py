"""What the PolicyTrainer tests put in DeepSpeed's place, and their small run config.

``GradEngine`` has DeepSpeed's engine surface (forward, backward, step, accumulation) on a
plain module: it accumulates gradients and never steps, so two trainers on the same weights
can have their gradients compared, and it counts forwards with and without grad.
"""

from __future__ import annotations

import torch

from common.config import build
from learner.rl.config import PPOConfig


class GradEngine(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, accum: int) -> None:
        super().__init__()
        self.module, self.accum = model, accum
        self.forwards = {"grad": 0, "no_grad": 0}

    def forward(self, *args, **kwargs):
        self.forwards["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum).backward()

    def step(self) -> None:
        pass

    def gradient_accumulation_steps(self) -> int:
        return self.accum

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.module.parameters()]


def small_ppo_config(model_dir, **kw) -> PPOConfig:
    """4 prompts x 2 samples, micro-batches of 4, no KL; ``kw`` overrides."""
    base = dict(
        pretrain=str(model_dir),
        prompt_data="p",
        advantage_estimator="group_norm",
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        train_batch_size=8,
        micro_train_batch_size=4,
        micro_rollout_batch_size=4,
        generate_max_len=4,
        init_kl_coef=0.0,
        seed=0,
    )
    return build(PPOConfig, **{**base, **kw})
