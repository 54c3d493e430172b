"""``learner.train_ppo``'s run: named set-up steps, then a schedule's ``step`` per training step.

Every learner rank runs ``run``, which reads top to bottom:

    init_process        torch.distributed, logging, host memory, the checks of the world size
    load_data           tokenizer, prompts (rank 0 loads, every rank learns the count), steps
    build_trainer       the policy (and critic) engines and the PolicyTrainer
    build_rank0         rank 0 only: endpoint, pool, rollout client, publisher, controller, driver
    make_schedule       lockstep or async, with colocated turns under --colocate_all_models
    train               resume, first push, the steps, their evaluations and checkpoints
    save_final          the HF policy (and critic; with --train.enable_ema, the policy's average)

Errors a user must act on are ``RunError`` (one line, naming the flag or file); the entry point
(``learner.train_ppo.main``) turns them into an exit code. Nothing here exits the process.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from common.config import log_config
from learner.rl.build import (
    RunError,
    build_rank0,
    critic_save_path,
    make_critic,
    setup_logging,
    train_engine,
    trained_save_path,
)
from learner.rl.checkpoint import CheckpointError, check_resumable, rl_checkpointer
from learner.rl.config import PPOConfig
from learner.rl.evaluation import eval_due
from learner.rl.schedules import RunParts, Schedule, Turns, make_schedule, schedule_name
from learner.rl.schedules.base import broadcast_int
from learner.rl.schedules.colocated import check_colocated_push, make_turns
from learner.runtime.checkpoint import Checkpointer
from learner.runtime.flags import model_options

log = logging.getLogger("learner")


@dataclass
class Process:
    rank: int
    world_size: int
    device: torch.device

    @property
    def rank0(self) -> bool:
        return self.rank == 0


@dataclass
class Data:
    tokenizer: Any
    pad_id: int
    train_items: list  # rank 0's prompts (empty elsewhere)
    eval_items: list
    n_prompts: int  # on every rank
    steps_per_episode: int
    total_steps: int


@dataclass
class Models:
    engine: Any  # the policy's DeepSpeed engine
    critic: Any  # learner.rl.critic.Critic or None
    trainer: Any  # learner.rl.policy_trainer.PolicyTrainer


def run(cfg: PPOConfig) -> int:
    proc = init_process(cfg)
    data = load_data(cfg, proc)
    try:  # before the models load: a wrong or damaged resume fails in seconds, not minutes
        check_resumable(cfg, n_prompts=data.n_prompts)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    models = build_trainer(cfg, proc, data)
    rank0 = None
    if proc.rank0:
        rank0 = build_rank0(
            cfg, models.engine, data.tokenizer, data.train_items, data.eval_items, world_size=proc.world_size
        )
    weights = rank0.weights if rank0 is not None else _other_rank_weights(cfg, models.engine, proc.rank)
    driver = rank0.driver if rank0 is not None else None
    ok = False
    try:
        if driver is not None:
            driver.wait_for_services()
        turns = _turns(cfg, models, proc, rank0)
        schedule = make_schedule(RunParts(cfg, models.trainer, weights, driver, proc.device, data.total_steps, turns))
        if proc.rank0:
            log.info("schedule: %s", schedule_name(cfg.train))
        ckpt = rl_checkpointer(
            cfg, models.trainer, n_prompts=data.n_prompts, schedule=schedule, driver=driver, tokenizer=data.tokenizer
        )
        # What exists now (the model's modules, the prompts, every service's state) lives for the
        # whole run: full garbage collections need not walk it again. On rank 0 one walking it
        # stalled the controller's turn for 100+ ms (docs/scale.md).
        gc.freeze()
        train(cfg, schedule, ckpt, data.total_steps)
        save_final(cfg, models, data.tokenizer, proc)
        ok = True
    finally:
        if driver is not None:
            driver.close(ok)
        weights.close()
    return 0


def init_process(cfg: PPOConfig) -> Process:
    from learner.runtime import engine as E
    from learner.runtime.determinism import seed_everything

    # First: --full_determinism_enable's cuBLAS workspace is read when CUDA makes its first handle.
    seed_everything(cfg.train.seed, full_determinism=cfg.train.full_determinism_enable)
    info = E.init_distributed()
    setup_logging(info.rank)
    E.set_host_malloc(cfg.ds.host_malloc)
    try:
        cfg.check_world_size(info.world_size)
        check_colocated_push(cfg)
    except ValueError as e:
        raise RunError(str(e)) from None
    if info.rank == 0:
        log_config(cfg, log)
        for notice in cfg.notices:  # what the flags' checks changed, said once logging is up
            log.warning("%s", notice)
        _warn_foreign_flags(cfg)
        if cfg.train.full_determinism_enable:
            log.info("--full_determinism_enable: torch runs deterministic kernels only (slower on GPUs)")
    return Process(info.rank, info.world_size, info.device)


def _warn_foreign_flags(cfg: PPOConfig) -> None:
    # Ray placement and the other flags that cannot act are in cfg.notices (common.config's inert)
    for name, theirs in cfg.engine_flags_used():
        log.warning(
            "--%s configures vLLM engines, which rollout_service processes own here: start them with %s "
            "(launch.local passes it on)",
            name,
            theirs,
        )


def load_data(cfg: PPOConfig, proc: Process) -> Data:
    from transformers import AutoTokenizer

    from learner.rl.prompts import load_prompt_items

    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.model_name_or_path)
    if cfg.distill:  # every rank: the same files, the same verdict, so none waits on one that left
        from common.vocab import check_same_tokenizer

        try:
            check_same_tokenizer(cfg.actor.model_name_or_path, cfg.teacher.model_name_or_path)
        except (ValueError, OSError) as e:
            raise RunError(str(e)) from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_items, eval_items = [], []
    if proc.rank0:
        train_items = load_prompt_items(cfg, tokenizer, cfg.data.prompt_dataset)
        if cfg.eval.dataset:
            eval_items = load_prompt_items(cfg, tokenizer, cfg.eval.dataset, evaluation=True)
    n_items = broadcast_int(len(train_items))
    steps_per_episode = n_items // cfg.rollout.batch_size
    total_steps = steps_per_episode * cfg.train.num_episodes
    if cfg.train.max_steps:
        if cfg.train.max_steps > total_steps and proc.rank0:
            # Said at start-up: a run that stops early without a word looks like a crash or a bug.
            log.warning(
                "--max_steps %d: the prompts run out first: %d usable prompts / --rollout_batch_size %d = %d "
                "step(s) per episode x --num_episodes %d = %d step(s); raise --num_episodes to train longer",
                cfg.train.max_steps,
                n_items,
                cfg.rollout.batch_size,
                steps_per_episode,
                cfg.train.num_episodes,
                total_steps,
            )
        total_steps = min(total_steps, cfg.train.max_steps)
    if total_steps == 0:
        raise RunError(
            f"{cfg.data.prompt_dataset}: {n_items} usable prompts, fewer than one --rollout_batch_size "
            f"({cfg.rollout.batch_size}); nothing to train"
        )
    return Data(tokenizer, pad_id, train_items, eval_items, n_items, steps_per_episode, total_steps)


def build_trainer(cfg: PPOConfig, proc: Process, data: Data) -> Models:
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.runtime import engine as E

    samples_per_step = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    optimizer_steps = data.total_steps * cfg.train.max_epochs * (samples_per_step // cfg.train.batch_size)
    model = E.load_causal_lm(
        cfg.actor.model_name_or_path, **model_options(cfg.ds, cfg.actor.gradient_checkpointing_enable)
    )
    engine = train_engine(cfg, model, cfg.actor, optimizer_steps)
    critic = None
    if cfg.needs_critic:
        critic = make_critic(cfg, data.tokenizer, data.pad_id, proc.device, optimizer_steps)
    trainer = PolicyTrainer(engine, cfg, data.pad_id, proc.device, critic=critic)
    return Models(engine, critic, trainer)


def _other_rank_weights(cfg: PPOConfig, engine: Any, rank: int) -> Any:
    """A rank other than 0 only takes part in pushes (the gather under ZeRO-3)."""
    from learner.rl.weight_push import WeightPush, make_publisher

    return WeightPush(make_publisher(cfg, engine, rank=rank), None)


def _turns(cfg: PPOConfig, models: Models, proc: Process, rank0: Any) -> Turns:
    if not cfg.train.colocate_all:
        return Turns()
    trained = [models.engine] + ([models.critic.engine] if models.critic is not None else [])
    try:
        return make_turns(cfg, trained, proc.device, rank0.rollout if rank0 is not None else None)
    except ValueError as e:
        raise RunError(str(e)) from None


def train(cfg: PPOConfig, schedule: Schedule, ckpt: Checkpointer, total_steps: int) -> None:
    """Every rank: resume (``--load_checkpoint``), the first push, the steps, the evaluations
    (``learner.rl.evaluation.eval_due``: step 0 of a fresh run, every --eval_steps, the last
    step), the checkpoints. A step's evaluation comes before its checkpoint, which then keeps
    its score (--best_metric_key)."""
    try:
        resumed = ckpt.resume() if cfg.ckpt.load_enable else None
    except CheckpointError as e:
        raise RunError(str(e)) from None
    first = resumed.step + 1 if resumed else 1
    # Servers may have loaded other weights: everyone starts equal. A resumed run pushes the
    # resumed weights, as the version they were at (version k after step k), before any prompt
    # is handed out: servers that outlived the old learner still hold its later weights.
    schedule.start(resumed.step if resumed else 0)
    evaluating = bool(cfg.eval.dataset)
    if evaluating and not resumed:
        schedule.evaluate(0)
    for step in range(first, total_steps + 1):
        schedule.step(step)
        if evaluating and eval_due(step, total_steps, cfg.eval.steps):
            schedule.evaluate(step)
        if cfg.ckpt.save_steps > 0 and step % cfg.ckpt.save_steps == 0:
            with schedule.states_resident():
                ckpt.save(step)
    schedule.finish()


def save_final(cfg: PPOConfig, models: Models, tokenizer: Any, proc: Process) -> None:
    """The policy in HF format to --ckpt.output_dir; with --train.enable_ema its moving average
    goes there instead (where OpenRLHF writes it) and the trained policy to OUTPUT_DIR_trained."""
    from learner.runtime import engine as E

    ema = models.trainer.ema
    policy_dir = trained_save_path(cfg.ckpt) if ema is not None else cfg.ckpt.output_dir
    E.save_hf(models.engine, tokenizer, policy_dir)
    if proc.rank0:
        log.info("saved the policy to %s", policy_dir)
    if ema is not None:
        ema.save_hf(models.engine, tokenizer, cfg.ckpt.output_dir)
        if proc.rank0:
            log.info(
                "saved the policy's moving average (beta %g, %d updates) to %s",
                ema.beta,
                ema.updates,
                cfg.ckpt.output_dir,
            )
    if models.critic is not None and cfg.critic.save_value_network:
        E.save_hf(models.critic.engine, tokenizer, critic_save_path(cfg.ckpt))
        if proc.rank0:
            log.info("saved the critic to %s", critic_save_path(cfg.ckpt))
