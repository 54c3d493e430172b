"""The critic of PPO with GAE (``--advantage_estimator gae``): a value model and its update.

The value model is a transformers ``*ForSequenceClassification`` (``num_labels=1``) whose
``score`` head is applied to EVERY position, not only the last: V_t is read at the hidden
state that predicts response token t (column P - 1 + t, the same column as the policy's
logits), i.e. the value of the state before the action, as in OpenRLHF's ``CriticModel``.
Loading a trained reward model keeps its head (OpenRLHF's default: critic from the RM), the
tensor named by the checkpoint config's ``value_head_prefix``, else by ``--ds.value_head_prefix``
(default ``score``); a checkpoint without it (a causal LM) gives a fresh head, N(0, 1/(H+1))
(``learner.runtime.models.load_reward_model``). With ``--normalize_reward`` the values are
``(V - mean) / std`` by the mean/std in the critic's config (a reward model's), as OpenRLHF's.

The critic is its own DeepSpeed engine on every learner rank, with the policy's ZeRO stage
and batch sizes. Per rollout step (called by ``learner.rl.policy_trainer``):

1. ``values(rollout)``: V_old (N, T) of every sample, no grad, each rank scoring its strided
   slice and all-gathering (a collective: every rank runs the same number of forwards);
2. ``train_micro_batch``: 0.5 * max((V - R)^2, (V_clip - R)^2) per token
   (``learner.algorithms.losses.value_loss``, OpenRLHF's ``--value_clip`` semantics), aggregated as a
   mean over the GLOBAL valid tokens of the train batch and scaled by world x grad_accum
   like the policy loss, so the update equals the whole-batch update.

Differs from OpenRLHF: the value loss is always a token mean (``--loss_agg_mode`` shapes the
policy-gradient length bias, which a regression target does not have).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from learner.algorithms.losses import AggSpec, value_loss
from learner.algorithms.packing import unpack_to_padded
from learner.controller.types import Rollout
from learner.rl.experience import score_all_ranks
from learner.runtime import sequence_parallel
from learner.runtime.accumulation import OptimizerStep
from learner.runtime.models import ScalarHeadModel, load_reward_model

log = logging.getLogger(__name__)


class ValueModel(ScalarHeadModel):
    """``forward(input_ids, attention_mask, position_ids) -> (B, L)`` values at every position.

    ``mean``/``std`` (``--normalize_reward``): values are ``(head - mean) / std``, in training and
    scoring alike, as OpenRLHF's critic; 0 and 1 leave them as the head gives them."""

    def __init__(self, hf_model: torch.nn.Module, *, mean: float = 0.0, std: float = 1.0) -> None:
        super().__init__(hf_model)
        self.mean, self.std = mean, std

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """``attention_mask`` None with position ids restarting per sample: a packed row."""
        v = self.head(self.hidden_states(input_ids, attention_mask, position_ids))  # (B, L)
        return v if (self.mean, self.std) == (0.0, 1.0) else (v - self.mean) / self.std


def saved_statistics(config: Any) -> tuple[float, float] | None:
    """``(mean, std)`` a reward model's config carries (OpenRLHF's and our RM trainer's keys; a
    1-element list is read as its element), or None when it has none."""
    out = []
    for key in ("mean", "std"):
        v = getattr(config, key, None)
        v = v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return None
        out.append(float(v))
    return out[0], out[1]


def load_critic(
    path: str, *, tokenizer: Any = None, value_head_prefix: str = "score", normalize: bool = False, **load_kwargs: Any
) -> ValueModel:
    """A value model from a reward model (head kept) or a causal LM (fresh head); the head is
    the checkpoint's tensor ``learner.runtime.models.head_prefix`` names (``--ds.value_head_prefix``),
    and it is saved under that name, which its config records.

    ``normalize`` (``--normalize_reward``): values normalised by the mean/std in the critic's
    own config (a reward model's, written by its trainer), as OpenRLHF does; a config without
    them leaves the values as they are (OpenRLHF's 0 and 1), said in the log."""
    hf = load_reward_model(path, tokenizer=tokenizer, value_head_prefix=value_head_prefix, **load_kwargs).hf_model
    stats = saved_statistics(hf.config) if normalize else None
    if normalize:
        if stats is None:
            log.info("--normalize_reward: %s has no mean/std in its config: the critic's values stay as they are", path)
        elif not stats[1] > 0:
            raise ValueError(f"--normalize_reward: {path}/config.json has std={stats[1]}, must be > 0")
        else:
            log.info("--normalize_reward: the critic's values are (V - %g) / %g, from %s's config", *stats, path)
    mean, std = stats if stats is not None else (0.0, 1.0)
    return ValueModel(hf, mean=mean, std=std)


def response_values(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """(N, T) values of the states before each response token (0 at padding when packed).

    Padded batch (``collate``): column P - 1 + t. Packed batch: the columns of
    ``logit_index``, laid back into (N, T).
    """
    if sequence_parallel.split_of(model) is not None:  # --ds.ring_attn_size: this rank's columns only
        return sequence_parallel.response_values(model, batch)
    if "logit_index" in batch:  # one packed row; no attention mask, so samples stay apart
        v = model(batch["input_ids"], None, batch["position_ids"])  # (1, L)
        return unpack_to_padded(v[0, batch["logit_index"]], batch["action_mask"])
    v = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])  # (N, P+T)
    P, T = batch["prompt_width"], batch["response"].shape[1]
    return v[:, P - 1 : P - 1 + T]


class Critic:
    """The critic engine's two jobs in a PPO step: old values, then value-loss updates."""

    def __init__(
        self,
        engine: Any,
        *,
        pad_id: int,
        device: torch.device,
        micro_rollout_batch_size: int,
        value_clip: float | None,
        coalesce: bool = False,
        max_tokens: int = 0,
    ) -> None:
        self.engine = engine
        # --train.dynamic_batch_enable: the old values' micro-batches by this token budget
        # (--rollout.max_tokens_per_gpu); 0: micro_rollout_batch_size samples each
        self.max_tokens = max_tokens
        self.coalesce = coalesce  # reduce its gradients once per optimizer step (learner.runtime.accumulation)
        self.pad_id = pad_id
        self.device = device
        self.micro_rollout_batch_size = micro_rollout_batch_size
        self.value_clip = value_clip if value_clip and value_clip > 0 else None

    def values(self, rollout: Rollout, *, packed: bool = False) -> torch.Tensor:
        """(N, T) V_old of every sample on every rank (a collective); ``packed``: micro-batches
        as packed rows (``--packing_samples``)."""
        return score_all_ranks(
            self.engine,
            rollout,
            response_values,
            micro_batch=self.micro_rollout_batch_size,
            max_tokens=self.max_tokens,
            pad_id=self.pad_id,
            device=self.device,
            packed=packed,
        )

    def optimizer_step(self, micro_batches: int | None = None) -> OptimizerStep:
        """The window of one critic optimizer step: ``train_micro_batch`` each of its micro-batches
        (``micro_batches`` of them when planned by a token budget, else the engine's accumulation steps)."""
        return OptimizerStep(self.engine, coalesce=self.coalesce, micro_batches=micro_batches)

    def train_micro_batch(
        self,
        batch: dict[str, Any],
        old_values: torch.Tensor,
        returns: torch.Tensor,
        agg: AggSpec,
        world: int,
        step: OptimizerStep,
        *,
        weight: float = 1.0,
    ) -> dict[str, float]:
        """The value loss's backward on a collated micro-batch (padded or packed; old_values and
        returns already sliced to it, (n, T)) inside ``step`` (``optimizer_step()``); ``agg`` counts
        the whole global train batch. ``weight`` 0: a stand-in micro-batch (its forward and backward
        keep ZeRO's collectives in step with the other ranks, its gradient is 0), no metrics."""
        v = response_values(self.engine, batch)
        loss, m = value_loss(v, old_values, returns, batch["action_mask"], agg, value_clip=self.value_clip)
        # DeepSpeed averages over ranks and accumulation steps; agg already divides by the
        # global count, so scale that mean back out.
        step.backward(loss * (world * self.engine.gradient_accumulation_steps() * weight))
        return {k: float(x) for k, x in m.items()} if weight else {}


def token_mean_spec(mask: torch.Tensor) -> AggSpec:
    """The critic's aggregation over a global train batch mask (N, T)."""
    return AggSpec.from_masks([mask], "token_mean")
