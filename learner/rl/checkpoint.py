"""RL checkpoints: which parts of ``learner.train_ppo`` a checkpoint holds, and the settings a
resume must match. Saving, resuming, the layout, atomicity, manifests and damaged checkpoints
are ``learner.runtime.checkpoint``'s, shared with the supervised trainers (docs/checkpoints.md).

The parts (``state.json`` keys, directories)::

    policy/, critic/    the DeepSpeed engines (critic: --advantage_estimator gae)
    kl_ctl              the KL coefficient the adaptive controller has drifted to
    trainer             the policy trainer's optimizer-step count (--freezing_actor_steps)
    schedule            the schedule's state (async: its feed, see below; lockstep: none)
    driver, metrics     rank 0: the prompt stream's fingerprint; where metrics.jsonl stood
    rng/                per rank, with the trainer's mini-batch shuffling generator
    ema/                --train.enable_ema: the policy's moving average, each rank's shard
                        (``learner.runtime.ema``), restored bit-exactly
    hf/                 with --save_hf_ckpt, the policy in HF format (never read back); with
                        --disable_ds_ckpt the only weights: no policy/, critic/, ema/ (``weights``
                        says so, and --load_checkpoint refuses such a checkpoint, naming why).
                        With --train.enable_ema the average, as OpenRLHF's; hf_trained/ the policy
    weights             whether the DeepSpeed states were saved (``checkpoint_policy.DEEPSPEED_STATES``)

Which checkpoints survive a save: the newest --max_ckpt_num, and the one whose evaluation at
its own step scored best on --best_metric_key (``learner.runtime.checkpoint_policy.retained``).

Prompts in flight. A checkpoint is taken after a step's weight push, on every rank together. In
the lockstep schedule nothing is in flight then: step s's prompts are ``PromptStream.batch(s)``
and its dynamic-filtering refills ``PromptStream.refills(s)``, both functions of s alone, so the
step is the stream position and a resumed run draws from step k+1 exactly what the uninterrupted
run drew. The async schedule (off-policy, generation running ahead of training) has prompts
handed out for steps after k when step k is saved, and groups scored and waiting. Its
``state_dict()`` (``schedules/async_.py``) records them by their position in the prompt stream
(``PromptStream.at``): the next position to draw, the positions drawn but neither trained nor
dropped, and the feed's run-total counters. A resumed run issues those prompts again first, to
be generated anew by the resumed weights (prompts in flight cannot be recovered anyway, and
keeping the ready groups' samples would put tokens and log-probs beside every checkpoint for
groups worth at most K + 1 steps), then draws from the next position: no prompt is skipped or
trained twice (``learner.controller.feed.OffPolicyFeed.restore``). A checkpoint without that
state (made by lockstep) resumes async at ``batch(k+1)``, as lockstep would.
The controller's prompt ids restart at 0 in a new process; nothing here depends on them.
The weights a resumed run pushes first are version k: both schedules push version s after step s.

How this differs from OpenRLHF's: there the DeepSpeed ``client_state`` carries the data loader
position and a crash during a save can leave a half-written newest tag that ``latest`` points at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.config import get
from learner.rl.config import PPOConfig
from learner.rl.evaluation import scores_in
from learner.runtime import checkpoint as R
from learner.runtime.checkpoint_config import checkpoint_location
from learner.runtime.checkpoint_policy import DEEPSPEED_STATES, not_resumable, retained

CheckpointError = R.CheckpointError
CheckpointMismatch = R.CheckpointMismatch
EMA_PART = "ema"  # the policy's moving average (--train.enable_ema): ema/ds/rank_<r>.pt

# Flags a resume must share with the run that saved: the DeepSpeed shards, the prompt order
# and the meaning of "step k" depend on them. Anything else (learning rate, logging, timeouts)
# may change across a restart. The number of ranks is always matched (ZeRO shards are per rank).
# Saved under the flags' flat names (what checkpoints of every version hold), read at their paths.
MATCH_FIELDS = {
    "pretrain": "actor.model_name_or_path",
    "prompt_data": "data.prompt_dataset",
    "seed": "train.seed",
    "rollout_batch_size": "rollout.batch_size",
    "n_samples_per_prompt": "rollout.n_samples_per_prompt",
    "train_batch_size": "train.batch_size",
    "micro_train_batch_size": "train.micro_batch_size",
    "advantage_estimator": "algo.advantage.estimator",
    "zero_stage": "ds.zero_stage",
    "lora_rank": "ds.lora.rank",  # an adapter of another shape (or none) cannot load the saved one
    "lora_alpha": "ds.lora.alpha",
    "target_modules": "ds.lora.target_modules",
}


def ckpt_dir(cfg: PPOConfig) -> Path:
    return checkpoint_location(cfg.ckpt.path, cfg.ckpt.output_dir)


def match_fields(cfg: PPOConfig, *, n_prompts: int) -> dict[str, Any]:
    fields = {name: get(cfg, path) for name, path in MATCH_FIELDS.items()}
    fields["n_prompts"] = n_prompts  # same data file, same filtering of bad rows
    return fields


def check_resumable(cfg: PPOConfig, *, n_prompts: int) -> Path | None:
    """With --load_checkpoint: the checkpoint a resume will load (None: none, a fresh start),
    verified and checked against this run's settings before anything slow is built. On every
    rank. Raises CheckpointError (CheckpointMismatch, DamagedCheckpoint)."""
    if not cfg.ckpt.load_enable:
        return None
    path = R.check_resumable(ckpt_dir(cfg), match_fields(cfg, n_prompts=n_prompts))
    if path is not None:
        why = not_resumable(R.read_state(path).get("weights", {}))
        if why:
            raise CheckpointMismatch(f"cannot resume from {path}: {why}")
        if cfg.train.enable_ema and not (path / EMA_PART).is_dir():
            # an average started now would not be the run's: refused rather than resumed inexactly
            raise CheckpointMismatch(
                f"cannot resume from {path} with --train.enable_ema: it holds no moving average (it was saved "
                "without it); resume without --train.enable_ema, or point --ckpt_path elsewhere to start afresh"
            )
    return path


class SavedWeights:
    """Whether a checkpoint holds the DeepSpeed states (not with --disable_ds_ckpt): a part of the
    run state, so that a resume refuses a checkpoint it could not continue from, saying why."""

    def __init__(self, deepspeed_states: bool) -> None:
        self.deepspeed_states = deepspeed_states

    def state_dict(self) -> dict[str, Any]:
        return {DEEPSPEED_STATES: self.deepspeed_states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        why = not_resumable(state)
        if why:
            raise ValueError(why)


def rl_checkpointer(
    cfg: PPOConfig,
    trainer: Any,
    *,
    n_prompts: int,
    schedule: Any,
    driver: Any = None,
    tokenizer: Any = None,
) -> R.Checkpointer:
    """The run's checkpointer with its parts registered; on every rank (``driver``: rank 0's
    Driver, None elsewhere). ``trainer`` is the PolicyTrainer."""
    ckpt = R.Checkpointer(
        ckpt_dir(cfg),
        max_keep=cfg.ckpt.max_num,
        match=match_fields(cfg, n_prompts=n_prompts),
        retain=lambda steps, state: retained(steps, max_num=cfg.ckpt.max_num, scores=scores_in(state)),
    )
    save_ds = not cfg.ckpt.disable_ds  # else the HF policy (--save_hf_ckpt) is the checkpoint's only weights
    ckpt.add_engine("policy", trainer.engine, save=save_ds)
    if trainer.critic is not None:
        ckpt.add_engine("critic", trainer.critic.engine, save=save_ds)
    if trainer.ema is not None:  # its shards, one file per rank, as an engine writes its own
        ckpt.add_engine(EMA_PART, trainer.ema, save=save_ds)
    ckpt.add_state("weights", SavedWeights(save_ds))
    ckpt.add_state("kl_ctl", trainer.kl_ctl)
    ckpt.add_state("trainer", trainer)  # its step count (gates --freezing_actor_steps, entropy logging)
    ckpt.add_generator("trainer_generator", trainer.generator)
    ckpt.add_state("schedule", schedule)
    if driver is not None:
        ckpt.add_state("driver", driver)
        ckpt.add_state("metrics", driver.sink)
    if cfg.ckpt.save_hf:
        from learner.runtime import engine as E

        if trainer.ema is None:
            ckpt.add_export("hf", lambda d: E.save_hf(trainer.engine, tokenizer, d))
        else:  # the average where OpenRLHF puts it, the trained policy beside it
            ckpt.add_export("hf", lambda d: trainer.ema.save_hf(trainer.engine, tokenizer, d))
            ckpt.add_export("hf_trained", lambda d: E.save_hf(trainer.engine, tokenizer, d))
    return ckpt
