"""``learner.train_ppo``'s run: set-up, then a schedule's ``step`` per training step, then save.

Every learner rank runs ``run``. Rank 0 also builds the controller side (``Driver``: the
controller socket, prompts, metrics); all ranks build the trained engines and the weight
publisher. Which schedule runs is the flags' choice (``learner.rl.schedules.SCHEDULES``).
"""

from __future__ import annotations

import logging

import torch

from common.config import log_config
from learner.rl.build import (
    critic_save_path,
    make_controller,
    make_critic,
    sampling_params,
    setup_logging,
    train_engine,
)
from learner.rl.checkpoint import CheckpointError, check_resumable, rl_checkpointer
from learner.rl.config import PPOConfig
from learner.rl.schedules import SCHEDULES, RunParts, schedule_name
from learner.rl.schedules.base import broadcast_int
from learner.rl.schedules.colocated import check_colocated_push, make_turns

log = logging.getLogger("learner")


def run(cfg: PPOConfig) -> int:
    from transformers import AutoTokenizer

    from common.transport import Endpoint
    from learner.controller.pool import ServicePool
    from learner.rl.driver import Driver
    from learner.rl.metrics import metrics_writer
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.rl.prompts import PromptStream, load_prompt_items
    from learner.rl.weight_push import WeightPush
    from learner.runtime import engine as E

    info = E.init_distributed()
    setup_logging(info.rank)
    E.set_host_malloc(cfg.host_malloc)
    try:
        cfg.check_world_size(info.world_size)
    except ValueError as e:
        raise SystemExit(f"learner: {e}") from None
    rank0 = info.rank == 0
    if rank0:
        log_config(cfg, log)
        for name in cfg.ray_flags_used():
            log.warning(
                "--%s is a Ray placement flag; rayless has no placement: start the processes you want "
                "(torchrun --nproc_per_node/--nnodes for learners, one rollout_service per engine)",
                name,
            )
        for name, theirs in cfg.engine_flags_used():
            log.warning(
                "--%s configures vLLM engines, which rollout_service processes own here: start them with %s "
                "(launch.local passes it on)",
                name,
                theirs,
            )
    try:
        check_colocated_push(cfg)
    except ValueError as e:
        raise SystemExit(f"learner: {e}") from None
    torch.manual_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.pretrain)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    train_items, eval_items = [], []
    if rank0:
        train_items = load_prompt_items(cfg, tokenizer, cfg.prompt_data)
        eval_items = load_prompt_items(cfg, tokenizer, cfg.eval_data) if cfg.eval_data else []
    n_items = broadcast_int(len(train_items))
    steps_per_episode = n_items // cfg.rollout_batch_size
    total_steps = steps_per_episode * cfg.num_episodes
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    if total_steps == 0:
        raise SystemExit(
            f"{cfg.prompt_data}: {n_items} usable prompts, fewer than one --rollout_batch_size "
            f"({cfg.rollout_batch_size}); nothing to train"
        )
    try:  # before the models load: a wrong or damaged resume fails in seconds, not minutes
        check_resumable(cfg, n_prompts=n_items)
    except CheckpointError as e:
        raise SystemExit(f"learner: {e}") from None
    samples_per_step = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    optimizer_steps = total_steps * cfg.max_epochs * (samples_per_step // cfg.train_batch_size)

    model = E.load_causal_lm(
        cfg.pretrain,
        zero_stage=cfg.zero_stage,
        bf16=cfg.bf16,
        gradient_checkpointing=cfg.gradient_checkpointing,
        flash_attn=cfg.flash_attn,
    )
    engine = train_engine(cfg, model, cfg.actor_learning_rate, optimizer_steps)
    critic = (
        make_critic(cfg, tokenizer, pad_id, info.device, optimizer_steps) if cfg.advantage_estimator == "gae" else None
    )
    trainer = PolicyTrainer(engine, cfg, pad_id, info.device, critic=critic)
    sampling, greedy = sampling_params(cfg, tokenizer)
    weights = WeightPush(cfg, engine)
    driver = None
    ok = False
    try:
        if rank0:
            endpoint = Endpoint.bind(cfg.controller_bind, auth_dir=cfg.auth_dir or None)
            rollout = weights.connect(endpoint, ServicePool(endpoint, peer_timeout_s=cfg.peer_timeout_s))
            controller = make_controller(cfg, sampling, rollout, tokenizer, sync_joiners=weights.rank0_can_push_alone)
            driver = Driver(
                cfg,
                controller,
                PromptStream(train_items, cfg.rollout_batch_size, seed=cfg.seed if cfg.seed_sampling else None),
                metrics_writer(cfg),
                eval_items=eval_items,
                greedy=greedy,
            )
            driver.wait_for_services()
        turns = None
        if cfg.colocate_all_models:
            trained = [engine] + ([critic.engine] if critic is not None else [])
            try:
                turns = make_turns(cfg, trained, info.device, weights.rollout if rank0 else None)
            except ValueError as e:
                raise SystemExit(f"learner: {e}") from None
        parts = RunParts(cfg, trainer, weights, driver, info.device, total_steps, turns=turns)
        schedule = SCHEDULES[schedule_name(cfg)](parts)
        if rank0:
            log.info("schedule: %s", schedule.name)
        ckpt = rl_checkpointer(cfg, trainer, n_prompts=n_items, schedule=schedule, driver=driver, tokenizer=tokenizer)
        try:
            resumed = ckpt.resume() if cfg.load_checkpoint else None
        except CheckpointError as e:
            raise SystemExit(f"learner: {e}") from None
        first = resumed.step + 1 if resumed else 1
        # Servers may have loaded other weights: everyone starts equal. A resumed run pushes the
        # resumed weights, as the version they were at (version k after step k), before any
        # prompt is handed out: servers that outlived the old learner still hold its later weights.
        schedule.start(resumed.step if resumed else 0)
        if driver is not None and not resumed:
            driver.evaluate(0, "eval/accuracy")
        for step in range(first, total_steps + 1):
            schedule.step(step)
            if cfg.save_steps and step % cfg.save_steps == 0:
                with schedule.states_resident():
                    ckpt.save(step)
        schedule.finish()
        if driver is not None:
            driver.evaluate(total_steps, "eval/accuracy_final")
        E.save_hf(engine, tokenizer, cfg.save_path)
        if rank0:
            log.info("saved the policy to %s", cfg.save_path)
        if critic is not None and cfg.save_value_network:
            E.save_hf(critic.engine, tokenizer, critic_save_path(cfg))
            if rank0:
                log.info("saved the critic to %s", critic_save_path(cfg))
        ok = True
    finally:
        if driver is not None:
            driver.close(ok)
        weights.close()
    return 0
