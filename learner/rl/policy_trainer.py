"""One RL step on a rollout: old log-probs, KL, advantages, then the clipped policy update.

Runs on every learner rank with the same ``Rollout`` (see ``learner.rl.experience``):

1. old log-probs: each rank scores its slice of the batch with the current policy (no grad)
   and the slices are all-gathered, so every rank has them all. Skipped when they would equal
   the training forward's own log-probs (``PolicyTrainer.reuses_logprobs``: on-policy samples,
   one optimizer step, one epoch, nothing needs them before training), as TRL does: the ratio
   of that single update is exactly 1 either way;
2. rewards shaped (clip, overlong, stop-properly), KL to the reference per token, and
   advantages over the WHOLE batch — computed identically on every rank, hence exact group
   and global statistics without an extra collective;
3. ``max_epochs`` passes of PPO over shuffled global train batches: each rank takes a
   strided slice of each, the aggregation divides by the GLOBAL token (or sequence) count of
   that train batch, and the loss is scaled by ``world x grad_accum`` to undo DeepSpeed's
   averaging, so the update equals the whole-batch update.

With ``--advantage_estimator gae`` a ``learner.rl.critic.Critic`` adds its old values to step 2
(GAE advantages and returns) and a value-loss update to every micro-batch of step 3; during
the first ``--freezing_actor_steps`` + 1 steps only the critic is updated (OpenRLHF's count).

The difference between the learner's old log-probs and vLLM's sampling log-probs is logged
as ``rollout/logprob_diff`` over the samples of the weights being trained (lag 0): the health
metric of the weight sync and of numerics, ~0 when both sides hold the same weights. Samples
of older weights (the async schedule's lag) differ by the policy's own change, so
``rollout/logprob_diff_all``, over every sample, is logged apart; lockstep's are equal. When the
old-log-probs pass is skipped it is taken from the training forward (train mode: the same
values for models without dropout, which is every model this project trains).

The model projects onto the vocabulary only at the positions that predict response tokens
(HF's ``logits_to_keep``); the prompt's logits were computed and thrown away before. Entropy
over the full vocabulary is computed with grad only when it is in the loss
(``--entropy_loss_coef``), else without grad on logged steps only.

With ``--packing_samples`` every forward of the step (old log-probs, the critic's old values,
training) runs each micro-batch as ONE packed row: the samples end to end, position ids
restarting per sample, no padding computed (``learner.rl.experience.collate``). Results come
back in the padded (N, T) layout, so advantages, losses and metrics are unchanged (to float
rounding: ``tests/unit/rl/test_packing.py``). The reference log-probs come from the reward
service, not from a learner forward.

With ``--train.dynamic_batch_enable`` every pass's micro-batches are formed by a token budget
instead of a sample count (``learner.rl.micro_batches``: as many on every rank, the optimizer
window told their number), with the loss and gradients of fixed micro-batches
(``tests/unit/rl/test_dynamic_batch.py``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from common.tiled_logits import head_inputs, tile_bounds, token_logprobs
from common.weights.source import unwrap
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
from learner.algorithms.packing import unpack_to_padded
from learner.algorithms.shaping import clip_rewards, overlong_penalty, stop_properly_penalty
from learner.controller.types import Rollout
from learner.rl.config import PPOConfig
from learner.rl.critic import Critic, token_mean_spec
from learner.rl.distill_term import DistillTerm, topk_loss
from learner.rl.experience import collate, score_all_ranks
from learner.rl.micro_batches import plan_micro_batches
from learner.runtime import sequence_parallel
from learner.runtime.accumulation import OptimizerStep, engine_coalesces
from learner.runtime.ema import EMA
from learner.runtime.lora import base_hf_model
from learner.runtime.models import check_packable, tileable


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@functools.cache
def _takes_logits_to_keep(module_type: type[Any]) -> bool:
    """Whether an HF causal LM's forward can project only the last columns onto the vocabulary."""
    return "logits_to_keep" in inspect.signature(module_type.forward).parameters


def response_logprobs(
    model: Any,
    batch: dict[str, Any],
    temperature: float,
    with_entropy: bool = False,
    response_only: bool = True,
    entropy_grad: bool = True,
    tile_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, T) of the response tokens (and their entropy) under ``model``.

    With ``response_only`` (and a model that takes ``logits_to_keep``) only the columns that
    predict response tokens go through ``lm_head``. Padded batch: prompts are left-padded and
    responses right-padded (``collate``), so columns P-1 .. P+T-2, the predictions of the T
    response tokens, are the last T + 1 but one; the prompt's (N, P-1, V) logits were most of
    the old work (and memory). Packed batch (``logit_index`` present): the K columns of
    ``logit_index`` exactly, and the (K,) results are laid back into (N, T) with zeros at
    padding. ``entropy_grad=False`` computes the entropy for a metric only: no graph, no recompute.

    ``tile_tokens`` > 0 (``--ds.logits_tile_tokens``): the (N, T, V) logits are never built; the
    final hidden states of the ``action_mask`` positions go through the head that many at a time
    (``_tiled``), and positions outside ``action_mask`` get 0, as packed rows always had.
    """
    lp, ent, _ = response_forward(
        model,
        batch,
        temperature,
        with_entropy=with_entropy,
        response_only=response_only,
        entropy_grad=entropy_grad,
        tile_tokens=tile_tokens,
    )
    return lp, ent


def response_forward(
    model: Any,
    batch: dict[str, Any],
    temperature: float,
    *,
    with_entropy: bool = False,
    response_only: bool = True,
    entropy_grad: bool = True,
    tile_tokens: int = 0,
    topk_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``response_logprobs``' (lp, entropy) from one forward and, with ``topk_ids`` (N, T, K)
    (top-k distillation: the teacher's ids at each response position), the raw logits at those
    ids, (N, T, K) with grad, 0 outside ``action_mask`` (None without ``topk_ids``)."""
    if sequence_parallel.split_of(model) is not None:  # --ds.ring_attn_size: this rank's columns only
        if topk_ids is not None:
            raise ValueError("top-k distillation (--distill_topk) is not built for --ds.ring_attn_size > 1")
        lp, ent = sequence_parallel.response_logprobs(
            model, batch, temperature, with_entropy, entropy_grad, tile_tokens
        )
        return lp, ent, None
    T = batch["response"].shape[1]
    hf = base_hf_model(unwrap(model))
    hf_class: type = type(hf)  # `type`: mypy's `type[Any]` is not Hashable for the cache
    keep = response_only and _takes_logits_to_keep(hf_class)  # peft passes it on
    if keep and tile_tokens > 0 and tileable(hf):
        return _tiled(model, hf, batch, temperature, with_entropy, entropy_grad, tile_tokens, topk_ids)
    packed = "logit_index" in batch
    if packed:
        # No attention mask: transformers then finds the samples' boundaries in the position ids.
        cols = batch["logit_index"]
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            **({"logits_to_keep": cols} if keep else {}),
        )
        logits = out.logits[0] if keep else out.logits[0, cols]  # (K, V)
        labels = batch["response"][batch["action_mask"]]  # (K,)
    else:
        P = batch["prompt_width"]
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
            **({"logits_to_keep": T + 1} if keep else {}),
        )
        # (N, T, V): column P-1+t of the full sequence predicts response token t
        logits = out.logits[:, :T] if keep else out.logits[:, P - 1 : P - 1 + T]
        labels = batch["response"]
    lp = log_probs_from_logits(logits, labels, temperature=temperature)
    ent = None
    if with_entropy and entropy_grad:
        ent = entropy_from_logits(logits, temperature=temperature)
    elif with_entropy:
        with torch.no_grad():
            ent = entropy_from_logits(logits.detach(), temperature=temperature)
    top = None
    if topk_ids is not None:
        mask = batch["action_mask"]
        # packed: (K_rows, V) logits in mask order; padded: (N, T, V)
        top = logits.float().gather(-1, topk_ids[mask] if packed else topk_ids)
        # 0 outside action_mask, as the tiled and packed paths leave it (padding, environment tokens)
        top = _unpack_rows(top, mask) if packed else torch.where(mask[..., None], top, torch.zeros_like(top))
    if packed:
        mask = batch["action_mask"]
        lp = unpack_to_padded(lp, mask)
        ent = unpack_to_padded(ent, mask) if ent is not None else None
    return lp, ent, top


def _unpack_rows(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(K_rows, K) values of the ``mask`` positions, row-major, laid into (N, T, K) with 0 elsewhere."""
    out = rows.new_zeros((*mask.shape, rows.shape[-1]))
    return out.masked_scatter(mask[..., None].expand_as(out), rows)


def _tiled_gather(head: Any, hidden: torch.Tensor, ids: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """head(hidden)[r, ids[r]] for (R, H) rows and (R, K) ids, a tile of rows at a time, fp32;
    under autograd each tile's logits are made again in backward (as ``token_logprobs``)."""

    def tile(h: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return head(h).float().gather(-1, i)

    parts = [
        checkpoint(tile, hidden[a:b], ids[a:b], use_reentrant=False)
        if torch.is_grad_enabled()
        else tile(hidden[a:b], ids[a:b])
        for a, b in tile_bounds(hidden.shape[0], tile_tokens)
    ]
    return torch.cat(parts) if parts else hidden.new_zeros((0, ids.shape[-1]), dtype=torch.float32)


def _tiled(
    model: Any,
    hf: Any,
    batch: dict[str, Any],
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    tile_tokens: int,
    topk_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``response_forward`` through ``common.tiled_logits``: the model's forward up to the head's
    input, then tiles of the K = action_mask.sum() rows that predict counted tokens (and, with
    ``topk_ids``, the same rows' logits at those ids, tiles of their own)."""
    mask = batch["action_mask"]  # (N, T) bool
    head = hf.get_output_embeddings()
    if "logit_index" in batch:
        hidden = head_inputs(
            model,
            head,
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            logits_to_keep=batch["logit_index"],
        )[0]  # (K, H): the columns of logit_index, in mask order
    else:
        T = batch["response"].shape[1]
        hidden = head_inputs(
            model,
            head,
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
            logits_to_keep=T + 1,
        )[:, :T][mask]  # (K, H): row-major, as packed rows order them
    entropy = "none" if not with_entropy else "grad" if entropy_grad else "metric"
    lp, ent = token_logprobs(
        head, hidden, batch["response"][mask], temperature=temperature, tile_tokens=tile_tokens, entropy=entropy
    )
    top = _unpack_rows(_tiled_gather(head, hidden, topk_ids[mask], tile_tokens), mask) if topk_ids is not None else None
    return unpack_to_padded(lp, mask), (unpack_to_padded(ent, mask) if ent is not None else None), top


@dataclass
class StepResult:
    """What one ``PolicyTrainer.step`` returns, the same on every rank."""

    metrics: dict[str, float]
    # (N, T) float32 on CPU: the learner's log-probs of the sampled tokens before the update (the
    # proximal policy; zeros past each response). The async schedule logs the behaviour KL by lag.
    old_logprobs: torch.Tensor


class PolicyTrainer:
    def __init__(
        self, engine: Any, cfg: PPOConfig, pad_id: int, device: torch.device, critic: Critic | None = None
    ) -> None:
        if cfg.needs_critic != (critic is not None):
            raise ValueError("a critic is needed exactly when --advantage_estimator is gae")
        self.engine = engine
        self.critic = critic
        self.steps_done = 0
        self.cfg = cfg
        self.pad_id = pad_id
        self.device = device
        self.kl_ctl = (
            AdaptiveKLController(cfg.algo.kl.init_coef, cfg.algo.kl.target, cfg.algo.kl.horizon)
            if cfg.algo.kl.target > 0
            else FixedKLController(cfg.algo.kl.init_coef)
        )
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        # --train.enable_ema: the average of the trained weights, after every policy optimizer step
        self.ema = EMA(engine, cfg.train.ema_beta) if cfg.train.enable_ema else None
        # Gradients reduced once per optimizer step, not per micro-batch (--coalesce_grad_reduction)
        self.coalesce = engine_coalesces(engine, cfg.ds.coalesce_grad_reduction, name="policy")
        self.packed = cfg.ds.packing_samples
        # --train.dynamic_batch_enable: micro-batches by a token budget, for training and for the
        # no-grad passes (learner.rl.micro_batches); 0: a fixed number of samples each
        self.dynamic = cfg.train.dynamic_batch_enable
        self.train_tokens = cfg.train.max_tokens_per_gpu if self.dynamic else 0
        self.score_tokens = (cfg.rollout.max_tokens_per_gpu or cfg.train.max_tokens_per_gpu) if self.dynamic else 0
        # --ds.ring_attn_size: the train batch is sliced by sequence-parallel group, not by rank
        if cfg.ds.ring_attn_size > 1:
            groups = sequence_parallel.init_groups(cfg.ds.ring_attn_size)
            for trained in (engine, critic.engine if critic is not None else None):
                if trained is not None:
                    sequence_parallel.register(trained, groups)
        self.sp = sequence_parallel.split_of(engine)
        if self.packed:
            check_packable(engine, "policy")
            if critic is not None:
                check_packable(critic.engine, "critic")

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own progress for a checkpoint (its engines, KL controller and shuffling
        generator are checkpoint parts of their own: ``learner.rl.checkpoint``)."""
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])

    def actor_updates(self) -> bool:
        """Whether this step updates the policy: not while the step, counted from 0, is <=
        ``--freezing_actor_steps`` N (the critic's warm-up), i.e. the first N + 1 steps are the
        critic's alone; OpenRLHF's count (``global_steps > freezing_steps``, from 0), where its
        help says N. Negative: every step."""
        return self.steps_done > self.cfg.critic.freezing_steps

    def optimizer_step(self, micro_batches: int | None = None) -> OptimizerStep:
        """The window of one policy optimizer step: ``backward`` each of its micro-batches
        (``micro_batches`` of them when planned by a token budget, else the engine's accumulation steps)."""
        return OptimizerStep(self.engine, coalesce=self.coalesce, micro_batches=micro_batches)

    # ---------------------------------------------------------------- step 1
    def old_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """(N, T) learner log-probs of every sample, all ranks together (a collective)."""
        return score_all_ranks(
            self.engine,
            rollout,
            lambda engine, batch: response_logprobs(
                engine, batch, self.cfg.rollout.temperature, tile_tokens=self.cfg.ds.logits_tile_tokens
            )[0],
            micro_batch=self.cfg.rollout.micro_batch_size,
            max_tokens=self.score_tokens,
            pad_id=self.pad_id,
            device=self.device,
            packed=self.packed,
        )

    # ---------------------------------------------------------------- step 2
    def shaped_rewards(self, rollout: Rollout) -> torch.Tensor:
        cfg = self.cfg
        r = rollout.rewards()  # (N,)
        if cfg.reward.overlong_buffer_len > 0:
            # the policy's tokens only: an agent's environment feedback is not the answer's length
            lengths = torch.tensor([s.action_len for s in rollout.samples])
            r = overlong_penalty(
                r,
                lengths,
                cfg.rollout.max_new_tokens,
                cfg.reward.overlong_buffer_len,
                cfg.reward.overlong_penalty_factor,
            )
        if cfg.reward.stop_properly_penalty_coef is not None:  # OpenRLHF's: >= 0 scales, < 0 replaces
            truncated = torch.tensor([s.finish_reason == "length" for s in rollout.samples])
            r = stop_properly_penalty(r, truncated, cfg.reward.stop_properly_penalty_coef)
        if cfg.reward.clip_range:
            r = clip_rewards(r, *cfg.reward.clip_range)
        return r

    # ---------------------------------------------------------------- step 3
    def reuses_logprobs(self, rollout: Rollout, on_policy: bool) -> bool:
        """Whether this step can skip the old-log-probs forward and use the training forward's.

        Exact when all of these hold: the samples come from the learner's current weights
        (``on_policy``: the schedule's promise; lockstep keeps it, an async schedule's lagging
        samples do not); the rollout is ONE optimizer step of ONE epoch, so every micro-batch
        runs on the weights the samples came from; the actor is updated this step (its forward
        is where the log-probs come from); and nothing needs them before training, i.e. no KL
        in the reward with a non-zero coefficient (advantages would depend on it). The old
        log-probs of such a step equal ``lp.detach()`` of the training forward, so ratio = 1 and
        the loss and gradient are the same. The same on every rank (same rollout and config),
        as it must be: the skipped pass is a collective.
        """
        cfg = self.cfg
        have_ref = all(s.ref_logprobs is not None for s in rollout.samples)
        kl_in_reward = have_ref and not cfg.algo.kl.use_loss and self.kl_ctl.value != 0
        return (
            on_policy
            and not cfg.train.recompute_old_logprobs
            and cfg.train.max_epochs == 1
            and len(rollout) == cfg.train.batch_size
            and self.actor_updates()
            and not kl_in_reward
            and not cfg.distill  # the teacher's term needs the old log-probs before training
        )

    def step(self, rollout: Rollout, *, on_policy: bool = False, version: int | None = None) -> StepResult:
        """One RL step on ``rollout`` (every rank, the same rollout).

        ``on_policy``: the caller (the schedule) vouches that every sample was generated by
        the weights the learner holds now, which lets ``reuses_logprobs`` skip a forward.
        ``version``: the policy version of those weights (step s trains version s - 1): the
        samples started by it are lag 0, the ones ``rollout/logprob_diff`` is taken over. None:
        every sample counts (a caller that has no versions).
        """
        cfg = self.cfg
        rank, world = _world()
        full = collate(rollout.samples, self.pad_id)  # CPU, whole batch: masks and stored log-probs
        mask = full["action_mask"]  # (N, T)
        reuse = self.reuses_logprobs(rollout, on_policy)
        # (N, T); with `reuse` filled in by the training forward below, each rank its own rows
        old_lp = torch.zeros(mask.shape, dtype=torch.float32) if reuse else self.old_logprobs(rollout)
        have_ref = all(s.ref_logprobs is not None for s in rollout.samples)
        rewards = self.shaped_rewards(rollout)
        kl_coef = self.kl_ctl.value
        kl_in_reward = have_ref and not cfg.algo.kl.use_loss
        # (N, T) KL to the reference; when the advantages do not need it, computed after training
        kl = (
            compute_kl(old_lp, full["ref_logprobs"], mask, estimator=cfg.algo.kl.estimator)
            if kl_in_reward and not reuse
            else None
        )
        old_values = self.critic.values(rollout, packed=self.packed) if self.critic is not None else None  # (N, T)
        if cfg.distill and cfg.algo.distill.topk:
            have = full["teacher_topk_ids"].shape[-1] if "teacher_topk_ids" in full else 0
            if have < cfg.algo.distill.topk:
                raise RuntimeError(
                    f"--distill_topk {cfg.algo.distill.topk}: the samples carry the teacher's top-{have} "
                    f"(reward_service --teacher_topk {cfg.algo.distill.topk} on every service)"
                )
        distill = (
            DistillTerm.of(
                rollout,
                full["teacher_logprobs"],
                old_lp,
                mask,
                # top-k: a loss term instead (below); the sampled-token term is measured only
                coef=0.0 if cfg.algo.distill.topk else cfg.algo.distill.coef,
                in_reward=cfg.needs_critic,
                center=cfg.algo.distill.center,
            )
            if cfg.distill
            else None
        )
        penalty, penalty_coef = (
            distill.token_penalty(kl, kl_coef) if distill is not None and distill.in_reward else (kl, kl_coef)
        )
        advantages, returns = compute_advantages(
            cfg.algo.advantage.estimator,
            rewards,
            mask,
            group_size=rollout.group_size,
            values=old_values,
            kl=penalty,  # None with `reuse`, which implies a zero coefficient: the KL term is 0 either way
            kl_coef=penalty_coef,
            gamma=cfg.algo.advantage.gamma,
            lambd=cfg.algo.advantage.lambd,
            std_norm=not cfg.algo.advantage.no_std_norm,
        )
        if distill is not None and not distill.in_reward:
            advantages = distill.add_to(advantages)
        update_actor = self.actor_updates()
        # Full-vocabulary entropy: with grad when in the loss, else a no-grad metric on logged steps.
        entropy_in_loss = cfg.actor.entropy_coef != 0
        log_entropy = entropy_in_loss or self.steps_done % cfg.logger.logging_steps == 0
        self.steps_done += 1

        metrics: dict[str, list[float]] = defaultdict(list)
        n = len(rollout)
        tbs = cfg.train.batch_size
        accum = self.engine.gradient_accumulation_steps()
        scale = world * accum  # undo DeepSpeed's mean over ranks and accumulation steps
        low, high = cfg.actor.clip_low_high
        for _ in range(cfg.train.max_epochs):
            perm = torch.randperm(n, generator=self.generator).tolist()  # same on every rank
            for start in range(0, n - tbs + 1, tbs):
                global_idx = perm[start : start + tbs]
                agg = AggSpec.from_masks(
                    [mask[global_idx]], cfg.actor.loss_agg_mode, max_len=cfg.rollout.max_new_tokens
                )
                value_agg = token_mean_spec(mask[global_idx]) if self.critic is not None else None
                dp_rank, dp_size = (self.sp.dp_rank, self.sp.dp_size) if self.sp else (rank, world)
                local = global_idx[dp_rank::dp_size]  # every rank of a sequence-parallel group: the same
                # As many on every rank (with a token budget: an all-reduce of the count; an empty
                # group is a stand-in micro-batch of weight 0, so ZeRO's collectives meet)
                plan = plan_micro_batches(
                    rollout.samples,
                    local,
                    size=cfg.train.micro_batch_size,
                    max_tokens=self.train_tokens,
                    packed=self.packed,
                    device=self.device,
                )
                # None: DeepSpeed's fixed accumulation steps (counted for ranks, not sequence-parallel groups)
                planned = len(plan) if self.dynamic or self.sp else None
                if self.dynamic:
                    metrics["policy/micro_batches"].append(float(len(plan)))
                with contextlib.ExitStack() as windows:  # one optimizer step of each trained engine
                    critic_step = windows.enter_context(self.critic.optimizer_step(planned)) if self.critic else None
                    policy_step = windows.enter_context(self.optimizer_step(planned)) if update_actor else None
                    for group in plan:
                        idx, weight = (group, 1.0) if group else (local[:1], 0.0)
                        batch = collate([rollout.samples[i] for i in idx], self.pad_id, self.device, packed=self.packed)
                        T = batch["response"].shape[1]

                        def sl(t, idx=idx, T=T):  # stored (N, T) -> this micro-batch
                            return t[idx, :T].to(self.device)

                        mmask = batch["action_mask"]
                        if critic_step is not None:
                            assert self.critic is not None and value_agg is not None  # both go with critic_step
                            critic_metrics = self.critic.train_micro_batch(
                                batch, sl(old_values), sl(returns), value_agg, world, critic_step, weight=weight
                            )
                            for k, v in critic_metrics.items():
                                metrics[f"critic/{k}"].append(v)
                        if policy_step is None:  # the actor is frozen this step
                            continue
                        topk = cfg.distill and cfg.algo.distill.topk > 0
                        lp, ent, top = response_forward(
                            self.engine,
                            batch,
                            cfg.rollout.temperature,
                            with_entropy=log_entropy,
                            entropy_grad=entropy_in_loss,
                            tile_tokens=cfg.ds.logits_tile_tokens,
                            topk_ids=batch["teacher_topk_ids"][..., : cfg.algo.distill.topk] if topk else None,
                        )
                        if reuse and weight and (self.sp is None or self.sp.rank == 0):
                            old_lp[idx, :T] = lp.detach().float().cpu()
                        loss, pm = policy_loss(
                            lp,
                            lp.detach() if reuse else sl(old_lp),
                            sl(advantages),
                            mmask,
                            agg,
                            loss_type=cfg.actor.policy_loss_type,
                            eps_clip_low=low,
                            eps_clip_high=high,
                            dual_clip=cfg.actor.dual_clip or None,
                            rollout_log_probs=batch["rollout_logprobs"],
                            is_correction=cfg.algo.advantage.is_correction or None,
                            is_low=cfg.algo.advantage.is_correction_threshold[0],
                            is_high=cfg.algo.advantage.is_correction_threshold[1],
                        )
                        if cfg.algo.kl.use_loss and have_ref:
                            kloss, km = kl_loss(
                                lp, batch["ref_logprobs"], mmask, agg, kl_coef=kl_coef, estimator=cfg.algo.kl.estimator
                            )
                            loss = loss + kloss
                            pm.update(km)
                        if top is not None:
                            dloss, dm = topk_loss(
                                top,
                                batch["teacher_topk_logprobs"][..., : cfg.algo.distill.topk],
                                mmask,
                                agg,
                                coef=cfg.algo.distill.coef,
                                beta=cfg.algo.distill.jsd_beta,
                                temperature=cfg.rollout.temperature,
                            )
                            loss = loss + dloss
                            pm.update({f"distill_{k}": v for k, v in dm.items()})
                        if ent is not None:
                            eloss, em = entropy_bonus(ent, mmask, agg, coef=cfg.actor.entropy_coef)
                            if entropy_in_loss:
                                loss = loss + eloss
                            pm.update(em)
                        policy_step.backward(loss * (scale * weight))
                        if not weight:  # a stand-in: its sample is another micro-batch's
                            continue
                        for k, v in pm.items():
                            metrics[f"policy/{k}"].append(float(v))
                if policy_step is not None and self.ema is not None:
                    self.ema.update()  # the window closed: the optimizer has stepped
        if reuse and world > 1:
            old_lp = old_lp.to(self.device)
            dist.all_reduce(old_lp)  # each row was filled on exactly one rank, zeros elsewhere
            old_lp = old_lp.cpu()
        if kl is None:
            kl = compute_kl(old_lp, full["ref_logprobs"] if have_ref else old_lp, mask, estimator=cfg.algo.kl.estimator)
        mean_kl = float(masked_mean(kl, mask))
        self.kl_ctl.update(float(kl.sum(-1).mean()), n)  # the controller wants per-sequence KL
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        out.update(logprob_diff_metrics(old_lp, full["rollout_logprobs"], mask, rollout, version))
        if distill is not None:
            out.update(distill.metrics(mask))
        out.update(
            {
                "rollout/reward": float(rollout.rewards().mean()),
                "rollout/shaped_reward": float(rewards.mean()),
                "rollout/response_len": float(mask.sum(-1).float().mean()),
                "rollout/truncated_frac": sum(s.finish_reason == "length" for s in rollout.samples) / n,
                "policy/kl_to_ref": mean_kl,
                "policy/kl_coef": kl_coef,
                "policy/advantage_abs": float(masked_mean(advantages.abs(), mask)),
                "policy/return_mean": float(masked_mean(returns, mask)),
                "policy/actor_updated": float(update_actor),
                "policy/old_logprobs_reused": float(reuse),
            }
        )
        return StepResult(out, old_lp)


def logprob_diff_metrics(
    old_lp: torch.Tensor, stored: torch.Tensor, mask: torch.Tensor, rollout: Rollout, version: int | None
) -> dict[str, float]:
    """``rollout/logprob_diff``: mean |learner - vLLM| log-prob over the tokens of the samples
    started by ``version`` (lag 0; every sample when ``version`` is None), absent when the step
    has none; ``rollout/logprob_diff_all``: the same over every sample. ``old_lp``, ``stored``,
    ``mask``: (N, T)."""
    diff = (old_lp - stored).abs()  # (N, T)
    out = {"rollout/logprob_diff_all": float(masked_mean(diff, mask))}
    lag0 = mask.bool()
    if version is not None:
        lag0 = lag0 & torch.tensor([s.policy_version == version for s in rollout.samples]).unsqueeze(1)
    if lag0.any():
        out["rollout/logprob_diff"] = float(masked_mean(diff, lag0))
    return out
