"""One RL step on a rollout: old log-probs, KL, advantages, then the clipped policy update.

Runs on every learner rank with the same ``Rollout`` (see ``learner.rl.experience``):

1. old log-probs: each rank scores its slice of the batch with the current policy (no grad)
   and the slices are all-gathered, so every rank has them all;
2. rewards shaped (clip, overlong, stop-properly), KL to the reference per token, and
   advantages over the WHOLE batch — computed identically on every rank, hence exact group
   and global statistics without an extra collective;
3. ``max_epochs`` passes of PPO over shuffled global train batches: each rank takes a
   strided slice of each, the aggregation divides by the GLOBAL token (or sequence) count of
   that train batch, and the loss is scaled by ``world x grad_accum`` to undo DeepSpeed's
   averaging, so the update equals the whole-batch update.

With ``--advantage_estimator gae`` a ``learner.rl.critic.Critic`` adds its old values to step 2
(GAE advantages and returns) and a value-loss update to every micro-batch of step 3; during
the first ``--freezing_actor_steps`` steps only the critic is updated.

The difference between the learner's old log-probs and vLLM's sampling log-probs is logged
as ``rollout/logprob_diff``: the health metric of the weight sync and of numerics.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from learner.algorithms.advantages import compute_advantages
from learner.algorithms.kl import AdaptiveKLController, FixedKLController, compute_kl
from learner.algorithms.losses import (
    AggSpec,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    log_probs_from_logits,
    masked_mean,
    policy_loss,
)
from learner.algorithms.shaping import clip_rewards, overlong_penalty, stop_properly_penalty
from learner.controller.types import Rollout
from learner.rl.config import PPOConfig
from learner.rl.critic import Critic, token_mean_spec
from learner.rl.experience import collate, score_all_ranks


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def response_logprobs(
    model: Any, batch: dict[str, Any], temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, T) of the response tokens (and their entropy) under ``model``."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    )
    P, T = batch["prompt_width"], batch["response"].shape[1]
    logits = out.logits[:, P - 1 : P - 1 + T]  # (N, T, V): position P-1+t predicts response token t
    lp = log_probs_from_logits(logits, batch["response"], temperature=temperature)
    ent = entropy_from_logits(logits, temperature=temperature) if with_entropy else None
    return lp, ent


class PolicyTrainer:
    def __init__(
        self, engine: Any, cfg: PPOConfig, pad_id: int, device: torch.device, critic: Critic | None = None
    ) -> None:
        if (cfg.advantage_estimator == "gae") != (critic is not None):
            raise ValueError("a critic is needed exactly when --advantage_estimator is gae")
        self.engine = engine
        self.critic = critic
        self.steps_done = 0
        self.cfg = cfg
        self.pad_id = pad_id
        self.device = device
        self.kl_ctl = (
            AdaptiveKLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
            if cfg.kl_target > 0
            else FixedKLController(cfg.init_kl_coef)
        )
        self.generator = torch.Generator().manual_seed(cfg.seed)

    # ---------------------------------------------------------------- step 1
    def old_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """(N, T) learner log-probs of every sample, all ranks together (a collective)."""
        return score_all_ranks(
            self.engine,
            rollout,
            lambda engine, batch: response_logprobs(engine, batch, self.cfg.temperature)[0],
            micro_batch=self.cfg.micro_rollout_batch_size,
            pad_id=self.pad_id,
            device=self.device,
        )

    # ---------------------------------------------------------------- step 2
    def shaped_rewards(self, rollout: Rollout) -> torch.Tensor:
        cfg = self.cfg
        r = rollout.rewards()  # (N,)
        if cfg.overlong_buffer_len > 0:
            lengths = torch.tensor([len(s.response) for s in rollout.samples])
            r = overlong_penalty(r, lengths, cfg.generate_max_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
        if cfg.stop_properly_penalty_coef >= 0:
            truncated = torch.tensor([s.finish_reason == "length" for s in rollout.samples])
            r = stop_properly_penalty(r, truncated, cfg.stop_properly_penalty_coef)
        if cfg.reward_clip_range:
            r = clip_rewards(r, *cfg.reward_clip_range)
        return r

    # ---------------------------------------------------------------- step 3
    def step(self, rollout: Rollout) -> dict[str, float]:
        cfg = self.cfg
        rank, world = _world()
        full = collate(rollout.samples, self.pad_id)  # CPU, whole batch: masks and stored log-probs
        mask = full["action_mask"]  # (N, T)
        old_lp = self.old_logprobs(rollout)  # (N, T)
        have_ref = all(s.ref_logprobs is not None for s in rollout.samples)
        ref_lp = full["ref_logprobs"] if have_ref else old_lp
        kl = compute_kl(old_lp, ref_lp, mask, estimator=cfg.kl_estimator)  # (N, T)
        rewards = self.shaped_rewards(rollout)
        kl_coef = self.kl_ctl.value
        old_values = self.critic.values(rollout) if self.critic is not None else None  # (N, T)
        advantages, returns = compute_advantages(
            cfg.advantage_estimator,
            rewards,
            mask,
            group_size=rollout.group_size,
            values=old_values,
            kl=None if cfg.use_kl_loss or not have_ref else kl,
            kl_coef=kl_coef,
            gamma=cfg.gamma,
            lambd=cfg.lambd,
            std_norm=not cfg.no_advantage_std_norm,
        )
        update_actor = self.steps_done >= cfg.freezing_actor_steps
        self.steps_done += 1

        metrics: dict[str, list[float]] = defaultdict(list)
        n = len(rollout)
        tbs = cfg.train_batch_size
        accum = self.engine.gradient_accumulation_steps()
        scale = world * accum  # undo DeepSpeed's mean over ranks and accumulation steps
        low, high = cfg.clip_low_high
        for _ in range(cfg.max_epochs):
            perm = torch.randperm(n, generator=self.generator).tolist()  # same on every rank
            for start in range(0, n - tbs + 1, tbs):
                global_idx = perm[start : start + tbs]
                agg = AggSpec.from_masks([mask[global_idx]], cfg.loss_agg_mode, max_len=cfg.generate_max_len)
                value_agg = token_mean_spec(mask[global_idx]) if self.critic is not None else None
                local = global_idx[rank::world]
                for m in range(0, len(local), cfg.micro_train_batch_size):
                    idx = local[m : m + cfg.micro_train_batch_size]
                    batch = collate([rollout.samples[i] for i in idx], self.pad_id, self.device)
                    T = batch["response"].shape[1]
                    sl = lambda t: t[idx, :T].to(self.device)  # noqa: E731 - stored (N, T) -> this micro-batch
                    mmask = batch["action_mask"]
                    if self.critic is not None:
                        for k, v in self.critic.train_micro_batch(
                            batch, sl(old_values), sl(returns), value_agg, world
                        ).items():
                            metrics[f"critic/{k}"].append(v)
                    if not update_actor:
                        continue
                    lp, ent = response_logprobs(self.engine, batch, cfg.temperature, with_entropy=True)
                    loss, pm = policy_loss(
                        lp,
                        sl(old_lp),
                        sl(advantages),
                        mmask,
                        agg,
                        loss_type=cfg.policy_loss_type,
                        eps_clip_low=low,
                        eps_clip_high=high,
                        dual_clip=cfg.dual_clip or None,
                        rollout_log_probs=batch["rollout_logprobs"],
                        is_correction=cfg.is_correction or None,
                        is_low=cfg.is_correction_low_high[0],
                        is_high=cfg.is_correction_low_high[1],
                    )
                    if cfg.use_kl_loss and have_ref:
                        kloss, km = kl_loss(
                            lp, batch["ref_logprobs"], mmask, agg, kl_coef=kl_coef, estimator=cfg.kl_estimator
                        )
                        loss = loss + kloss
                        pm.update(km)
                    eloss, em = entropy_bonus(ent, mmask, agg, coef=cfg.entropy_loss_coef)
                    if cfg.entropy_loss_coef:
                        loss = loss + eloss
                    pm.update(em)
                    self.engine.backward(loss * scale)
                    self.engine.step()
                    for k, v in pm.items():
                        metrics[f"policy/{k}"].append(float(v))
        mean_kl = float(masked_mean(kl, mask))
        self.kl_ctl.update(float(kl.sum(-1).mean()), n)  # the controller wants per-sequence KL
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        stored = full["rollout_logprobs"]
        out.update(
            {
                "rollout/logprob_diff": float(masked_mean((old_lp - stored).abs(), mask)),
                "rollout/reward": float(rollout.rewards().mean()),
                "rollout/shaped_reward": float(rewards.mean()),
                "rollout/response_len": float(mask.sum(-1).float().mean()),
                "rollout/truncated_frac": sum(s.finish_reason == "length" for s in rollout.samples) / n,
                "policy/kl_to_ref": mean_kl,
                "policy/kl_coef": kl_coef,
                "policy/advantage_abs": float(masked_mean(advantages.abs(), mask)),
                "policy/return_mean": float(masked_mean(returns, mask)),
                "policy/actor_updated": float(update_actor),
            }
        )
        return out
