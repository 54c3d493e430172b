"""The lockstep schedule of ``learner.train_ppo``: collect -> train -> push, every step.

Every learner rank runs ``run``; rank 0 also drives the controller. Ranks meet at three
collectives per step — the rollout broadcast, the optimizer steps, the weight gather — and a
one-integer broadcast before each step that says whether to go on, so a controller failure
stops every rank with its error instead of leaving them waiting.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.config import log_config
from common.protocol import SamplingParams
from learner.rl.config import PPOConfig

log = logging.getLogger("learner")


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s learner[{rank}] %(levelname)s %(name)s: %(message)s", force=True
    )


class MetricsSink:
    """metrics.jsonl (what launch.local's progress bar reads) + TensorBoard, rank 0 only."""

    def __init__(self, cfg: PPOConfig) -> None:
        out = Path(cfg.save_path)
        out.mkdir(parents=True, exist_ok=True)
        self.path = Path(cfg.metrics_file or out / "metrics.jsonl")
        self.fh = open(self.path, "a", buffering=1)
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(cfg.use_tensorboard or str(out / "tensorboard"))
        except Exception as e:  # noqa: BLE001 - TensorBoard is optional; say so once
            log.warning("TensorBoard disabled: %s", e)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.fh.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.fh.close()
        if self.tb is not None:
            self.tb.close()


def _flag(value: int) -> int:
    """Rank 0's decision, broadcast to all ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.broadcast(t, 0)
    return int(t.item())


def run(cfg: PPOConfig) -> int:
    from transformers import AutoTokenizer

    from learner.rl.experience import broadcast_rollout
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.rl.prompts import load_prompt_items
    from learner.rl.weight_push import WeightPush
    from learner.runtime import engine as E

    info = E.init_distributed()
    setup_logging(info.rank)
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
    torch.manual_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.pretrain)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    controller = sink = None
    train_items: list = []
    eval_items: list = []
    if rank0:
        train_items = load_prompt_items(cfg, tokenizer, cfg.prompt_data)
        eval_items = load_prompt_items(cfg, tokenizer, cfg.eval_data) if cfg.eval_data else []
    n_items = _flag(len(train_items))
    steps_per_episode = n_items // cfg.rollout_batch_size
    total_steps = steps_per_episode * cfg.num_episodes
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    if total_steps == 0:
        raise SystemExit(
            f"{cfg.prompt_data}: {n_items} usable prompts, fewer than one --rollout_batch_size "
            f"({cfg.rollout_batch_size}); nothing to train"
        )
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
        _make_critic(cfg, tokenizer, pad_id, info.device, optimizer_steps) if cfg.advantage_estimator == "gae" else None
    )
    trainer = PolicyTrainer(engine, cfg, pad_id, info.device, critic=critic)
    sampling = SamplingParams(
        n=cfg.n_samples_per_prompt,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.generate_max_len,
        stop_token_ids=_stop_ids(tokenizer),
        seed=None,
    )
    greedy = SamplingParams(
        n=1, temperature=0.0, max_new_tokens=cfg.generate_max_len, stop_token_ids=sampling.stop_token_ids
    )
    weights = WeightPush(cfg, engine)
    code = 0
    try:
        if rank0:
            controller = _make_controller(cfg, sampling, weights, tokenizer)
            sink = MetricsSink(cfg)
            log.info(
                "controller listening on %s; waiting for %d rollout server(s) and %d reward service(s)",
                controller.endpoint.address,
                cfg.min_rollout_servers,
                cfg.min_reward_services,
            )
            controller.wait_for_services(cfg.min_rollout_servers, cfg.min_reward_services, cfg.wait_for_services_s)
            check_reward_sources(cfg, controller.pool.alive("reward"))
        weights.push(0, controller)  # servers may have loaded other weights: everyone starts equal
        if rank0 and eval_items:
            acc = _evaluate(controller, eval_items, greedy, cfg)
            sink.write(0, {"eval/accuracy": acc})
            log.info("eval accuracy before training: %.3f on %d prompts", acc, len(eval_items))
        t_start = time.time()
        for step in range(1, total_steps + 1):
            t0 = time.time()
            rollout = None
            if rank0:
                offset = ((step - 1) % steps_per_episode) * cfg.rollout_batch_size
                batch = train_items[offset : offset + cfg.rollout_batch_size]
                res = controller.collect(len(batch), batch, timeout_s=cfg.generate_timeout_s + cfg.score_timeout_s)
                rollout = res.rollout
                if cfg.dynamic_filtering:
                    # Refills draw the prompts that follow this step's batch, cycling.
                    following = itertools.islice(itertools.cycle(train_items), offset + len(batch), None)
                    more = lambda k, it=following: list(itertools.islice(it, k))  # noqa: E731

                    rollout, filter_stats = filter_and_refill(controller, cfg, rollout, more)
                go = 1 if len(rollout) >= cfg.train_batch_size else 2
            else:
                go = 0
            go = _flag(go)
            if go == 2:  # everything failed scoring (or was filtered): skip the update, keep the run going
                if rank0:
                    log.warning("step %d: too few scored samples to train (%d); skipping", step, len(rollout))
                    if cfg.dynamic_filtering:
                        sink.write(step, {**filter_stats, "step_skipped": 1})
                continue
            t_gen = time.time() - t0
            rollout = broadcast_rollout(rollout, cfg.n_samples_per_prompt, device=info.device)
            rollout.samples = rollout.samples[: len(rollout) // cfg.train_batch_size * cfg.train_batch_size]
            metrics = trainer.step(rollout)
            t_train = time.time() - t0 - t_gen
            weights.push(step, controller)
            if rank0:
                metrics.update(
                    _run_metrics(
                        controller, res, len(rollout), t_gen, t_train, time.time() - t0, step, total_steps, t_start
                    )
                )
                if cfg.dynamic_filtering:
                    metrics.update(filter_stats)
                if step % cfg.logging_steps == 0 or step == total_steps:
                    sink.write(step, metrics)
                    log.info(
                        "step %d/%d reward %.3f logprob_diff %.2e kl %.4f gen %.1fs train %.1fs%s",
                        step,
                        total_steps,
                        metrics["rollout/reward"],
                        metrics["rollout/logprob_diff"],
                        metrics["policy/kl_to_ref"],
                        t_gen,
                        t_train,
                        f" value_loss {metrics['critic/value_loss']:.4f}" if "critic/value_loss" in metrics else "",
                    )
            if cfg.save_steps and step % cfg.save_steps == 0:
                E.save_hf(engine, tokenizer, Path(cfg.save_path) / f"step_{step}")
        if rank0 and eval_items:
            acc = _evaluate(controller, eval_items, greedy, cfg)
            sink.write(total_steps, {"eval/accuracy_final": acc})
            log.info("eval accuracy after training: %.3f", acc)
        E.save_hf(engine, tokenizer, cfg.save_path)
        if rank0:
            log.info("saved the policy to %s", cfg.save_path)
        if critic is not None and cfg.save_value_network:
            E.save_hf(critic.engine, tokenizer, critic_save_path(cfg))
            if rank0:
                log.info("saved the critic to %s", critic_save_path(cfg))
    except BaseException:
        code = 1
        raise
    finally:
        if rank0 and controller is not None:
            controller.shutdown_services("training finished" if code == 0 else "learner failed")
            controller.endpoint.close()
        if sink is not None:
            sink.close()
        weights.close()
    return code


def filter_and_refill(controller: Any, cfg: PPOConfig, rollout: Any, more_items: Any) -> tuple[Any, dict]:
    """DAPO dynamic sampling on rank 0, before the broadcast: drop groups whose rewards are
    all equal (``learner.algorithms.shaping.dynamic_filter_mask``, on the raw rewards) and collect more
    prompts, a ``--rollout_batch_size`` at a time (``more_items(k)`` gives the next k), until
    that many groups are kept or ``--dynamic_filtering_max_collects`` extra collects are spent.
    Kept groups beyond the batch are dropped. Giving up is a warning: the step trains on what
    was kept (ppo_loop truncates it to a multiple of --train_batch_size, or skips the step
    when that is less than one train batch)."""
    from learner.algorithms.shaping import dynamic_filter_mask
    from learner.rl.experience import Rollout

    G, want = cfg.n_samples_per_prompt, cfg.rollout_batch_size
    reward_range = tuple(cfg.dynamic_filtering_reward_range) or None
    kept: list = []
    seen = filtered = extra = 0

    def absorb(ro) -> None:
        nonlocal seen, filtered
        if not ro.samples:
            return
        keep = dynamic_filter_mask(ro.rewards(), G, reward_range).tolist()  # (groups,)
        seen += len(keep)
        filtered += keep.count(False)
        for g, k in enumerate(keep):
            if k:
                kept.extend(ro.samples[g * G : (g + 1) * G])

    absorb(rollout)
    while len(kept) < want * G and extra < cfg.dynamic_filtering_max_collects:
        items = more_items(want)
        extra += 1
        res = controller.collect(len(items), items, timeout_s=cfg.generate_timeout_s + cfg.score_timeout_s)
        absorb(res.rollout)
    if len(kept) < want * G:
        log.warning(
            "dynamic filtering: %d of %d groups kept after %d extra collect(s) "
            "(--dynamic_filtering_max_collects); training on fewer",
            len(kept) // G,
            want,
            extra,
        )
    kept = kept[: want * G]
    stats = {
        "filter/groups_seen": seen,
        "filter/groups_filtered": filtered,
        "filter/groups_kept": len(kept) // G,
        "filter/extra_collects": extra,
        "filter/kept_frac": (seen - filtered) / max(1, seen),
    }
    log.info(
        "dynamic filtering: %d of %d groups filtered (all rewards equal%s), %d extra collect(s)",
        filtered,
        seen,
        f" or mean outside {reward_range}" if reward_range else "",
        extra,
    )
    return Rollout(kept, G), stats


def critic_save_path(cfg: PPOConfig) -> str:
    """Where --save_value_network writes the critic: next to the policy, as OpenRLHF does."""
    return str(cfg.save_path).rstrip("/") + "_critic"


def _make_critic(cfg: PPOConfig, tokenizer: Any, pad_id: int, device: torch.device, optimizer_steps: int):
    """The critic's own DeepSpeed engine: same ZeRO stage and batch sizes as the policy."""
    from learner.rl.critic import Critic, load_critic

    path = cfg.critic_path
    log.info(
        "critic: value model from %s (lr %g, value_clip %g, actor frozen for %d step(s))",
        path,
        cfg.critic_learning_rate,
        cfg.value_clip,
        cfg.freezing_actor_steps,
    )
    model = load_critic(
        path,
        tokenizer=tokenizer,
        zero_stage=cfg.zero_stage,
        bf16=cfg.bf16,
        gradient_checkpointing=cfg.gradient_checkpointing,
        flash_attn=cfg.flash_attn,
    )
    engine = train_engine(cfg, model, cfg.critic_learning_rate, optimizer_steps)
    return Critic(
        engine,
        pad_id=pad_id,
        device=device,
        micro_rollout_batch_size=cfg.micro_rollout_batch_size,
        value_clip=cfg.value_clip,
    )


def train_engine(cfg: PPOConfig, model: Any, learning_rate: float, optimizer_steps: int) -> Any:
    """The DeepSpeed engine of a trained model (policy or critic) with train_ppo's optimizer flags."""
    from learner.runtime import engine as E

    return E.make_engine(
        model,
        zero_stage=cfg.zero_stage,
        bf16=cfg.bf16,
        train_batch_size=cfg.train_batch_size,
        micro_train_batch_size=cfg.micro_train_batch_size,
        learning_rate=learning_rate,
        num_training_steps=max(1, optimizer_steps),
        weight_decay=cfg.l2,
        betas=tuple(cfg.adam_betas),
        adam_offload=cfg.adam_offload,
        grad_clip=cfg.max_norm,
        lr_scheduler="constant_with_warmup",
        lr_warmup_ratio=cfg.lr_warmup_ratio,
    )


def check_reward_sources(cfg: PPOConfig, peers: list) -> None:
    """The learner's flags promise sources (KL needs reference log-probs, --reward_pretrain a
    reward model); fail at start-up, naming the services, if none of them provides one."""
    sources = {p.name: set(p.capabilities.get("sources", [])) for p in peers}
    want = []
    if cfg.kl_needed:
        want.append(
            (
                "ref",
                "KL (--init_kl_coef > 0 or --use_kl_loss) needs reference log-probs: start a reward "
                "service with --ref_pretrain",
            )
        )
    if cfg.reward_pretrain:
        want.append(("rm", "--reward_pretrain is set: start a reward service with --reward_pretrain"))
    for source, why in want:
        if not any(source in s for s in sources.values()):
            raise SystemExit(f"{why} (connected reward services and their sources: {sources})")


def _stop_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None)


def _make_controller(cfg: PPOConfig, sampling: SamplingParams, weights: Any, tokenizer: Any):
    from common.transport import Endpoint
    from learner.controller.controller import Controller
    from learner.controller.ledger import PromptLedger
    from learner.controller.pool import ServicePool

    endpoint = Endpoint.bind(cfg.controller_bind)
    pool = ServicePool(endpoint, peer_timeout_s=cfg.peer_timeout_s)
    ledger = PromptLedger(generate_timeout_s=cfg.generate_timeout_s, score_timeout_s=cfg.score_timeout_s)
    return Controller(
        weights.rollout_client(endpoint, pool),
        ledger,
        sampling=sampling,
        sync_joiners_in_pump=weights.rank0_can_push_alone,
        detokenize=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
    )


def _evaluate(controller, items, greedy: SamplingParams, cfg: PPOConfig) -> float:
    """Mean score (exact-match accuracy for rule rewards) of greedy answers; not trained on."""
    saved = controller.sampling
    controller.sampling = greedy
    try:
        res = controller.collect(len(items), items, timeout_s=cfg.generate_timeout_s + cfg.score_timeout_s)
    finally:
        controller.sampling = saved
    r = res.rollout.rewards()
    return float(r.mean()) if len(r) else math.nan


def _run_metrics(controller, res, n_samples, t_gen, t_train, t_step, step, total_steps, t_start) -> dict[str, float]:
    toks = sum(len(s.response) for s in res.rollout.samples)
    elapsed = time.time() - t_start
    return {
        "time/generate_s": t_gen,
        "time/train_s": t_train,
        "time/step_s": t_step,
        "time/eta_s": elapsed / step * (total_steps - step),
        "time/total_steps": total_steps,
        "perf/rollout_tokens_per_s": toks / max(t_gen, 1e-6),
        "ledger/reissued": controller.ledger.counters["reissued"],
        "ledger/duplicates": controller.ledger.counters["duplicates"],
        "ledger/failed_groups": res.failed_groups,
        "pool/died": controller.pool.counters["died"],
        "pool/rollout_servers": len(controller.pool.alive("rollout")),
        "samples": n_samples,
    }
