"""Set-up pieces of an RL run: the trained engines, rank 0's side, the sampling settings.

Called once by ``learner.rl.run``; each builder takes the resolved ``PPOConfig`` so the flag
-> object mapping lives in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.protocol import Error, Hello, RewardCapabilities, RolloutCapabilities, SamplingParams
from learner.controller.scoring import EpisodeScoring, Scoring, ServiceScoring
from learner.rl.config import PPOConfig
from learner.rl.config.sections import EvalSection, RolloutSection
from learner.runtime.checkpoint_config import CkptSection
from learner.runtime.flags import OptimizerFields, engine_options, model_options
from learner.runtime.tracking import public_config

log = logging.getLogger("learner")


class RunError(RuntimeError):
    """An RL run that cannot start or go on, for a reason its one-line message names (a flag,
    a file, a missing service). ``learner.train_ppo.main`` prints it and exits 1."""


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s learner[{rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def sampling_params(
    rollout: RolloutSection, evaluation: EvalSection, tokenizer: Any
) -> tuple[SamplingParams, SamplingParams]:
    """(training sampling, evaluation sampling): evaluation draws --eval_n_samples_per_prompt at
    --eval_temperature (0: greedy), and is otherwise sampled as training is."""
    stop = sorted(i for i in {tokenizer.eos_token_id} if i is not None)
    sampling = SamplingParams(
        n=rollout.n_samples_per_prompt,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=stop,
        seed=None,
    )
    held_out = SamplingParams(
        n=evaluation.n_samples_per_prompt,
        temperature=evaluation.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=stop,
        seed=None,
    )
    return sampling, held_out


@dataclass
class Rank0:
    """Rank 0's side of an RL run (the controller's), built by ``build_rank0``."""

    rollout: Any  # learner.controller.rollout_client.RolloutClient
    weights: Any  # learner.rl.weight_push.WeightPush with rank 0's FleetWeights
    driver: Any  # learner.rl.driver.Driver


def build_rank0(
    cfg: PPOConfig, engine: Any, tokenizer: Any, train_items: list, eval_items: list, *, world_size: int
) -> Rank0:
    """Rank 0's objects, each handed what it needs when it is made, in dependency order: the
    controller's endpoint, the pool of services on it, the rollout client (the pool's reader and
    the weight publisher's control channel), the publisher, the fleet's weights, the controller,
    the driver. Nothing is wired in afterwards."""
    from common.transport import Endpoint
    from learner.controller.controller import Controller
    from learner.controller.ledger import PromptLedger
    from learner.controller.pool import ServicePool
    from learner.controller.rollout_client import RolloutClient
    from learner.controller.weight_fleet import FleetWeights
    from learner.rl.driver import Driver
    from learner.rl.evaluation import Evaluator
    from learner.rl.metrics import metrics_writer
    from learner.rl.prompts import PromptStream
    from learner.rl.weight_push import WeightPush, make_publisher, rank0_syncs_joiners

    sampling, eval_sampling = sampling_params(cfg.rollout, cfg.eval, tokenizer)

    def decode(ids: list[list[int]]) -> list[str]:
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    endpoint = Endpoint.bind(cfg.services.controller_bind, auth_dir=cfg.services.auth_dir or None)
    try:
        pool = ServicePool(endpoint, peer_timeout_s=cfg.services.peer_timeout_s, admit=rollout_admission(cfg))
        rollout = RolloutClient(endpoint, pool)
        publisher = make_publisher(cfg, engine, rank=0, control=rollout)
        fleet = FleetWeights(pool, publisher)
        controller = Controller(
            rollout,
            PromptLedger(
                generate_timeout_s=cfg.services.generate_timeout_s, score_timeout_s=cfg.services.score_timeout_s
            ),
            sampling=sampling,
            weights=fleet,
            sync_joiners_in_pump=rank0_syncs_joiners(cfg, world_size),
            detokenize=decode,
            agent=cfg.agent_params(),
            scoring=sample_scoring(cfg),
            drop_failed_episodes=cfg.agent.failure == "drop",
        )
        seed = cfg.train.seed if cfg.rollout.seed_sampling else None
        stream = PromptStream(train_items, cfg.rollout.batch_size, seed=seed)
        evaluator = None
        if eval_items:
            evaluator = Evaluator(eval_items, eval_sampling, threshold=cfg.eval.pass_threshold, seed=seed)
        driver = Driver(
            cfg,
            controller,
            stream,
            metrics_writer(cfg.logger, cfg.ckpt.output_dir, public_config(cfg)),
            evaluator=evaluator,
            decode=decode,
        )
    except BaseException:
        endpoint.close()
        raise
    return Rank0(rollout, WeightPush(publisher, fleet), driver)


def critic_save_path(ckpt: CkptSection) -> str:
    """Where --save_value_network writes the critic: next to the policy, as OpenRLHF does."""
    return str(ckpt.output_dir).rstrip("/") + "_critic"


def trained_save_path(ckpt: CkptSection) -> str:
    """Where the trained policy goes with --train.enable_ema: next to OUTPUT_DIR, which holds the
    moving average, as OpenRLHF's does (it writes no trained policy then)."""
    return str(ckpt.output_dir).rstrip("/") + "_trained"


def make_critic(cfg: PPOConfig, tokenizer: Any, pad_id: int, device: torch.device, optimizer_steps: int) -> Any:
    """The critic's own DeepSpeed engine: same ZeRO stage and batch sizes as the policy."""
    from learner.rl.critic import Critic, load_critic
    from learner.runtime.accumulation import engine_coalesces

    path = cfg.critic_path
    log.info(
        "critic: value model from %s (lr %g, value_clip %g, actor frozen for the first %d step(s))",
        path,
        cfg.critic.adam.lr,
        cfg.critic.value_clip,
        max(cfg.critic.freezing_steps + 1, 0),  # --freezing_actor_steps N: N + 1 steps (OpenRLHF's count)
    )
    model = load_critic(
        path,
        tokenizer=tokenizer,
        value_head_prefix=cfg.ds.value_head_prefix,
        normalize=cfg.reward.normalize_enable,
        **model_options(cfg.ds, cfg.actor.gradient_checkpointing_enable),
    )
    engine = train_engine(cfg, model, cfg.critic, optimizer_steps)
    return Critic(
        engine,
        pad_id=pad_id,
        device=device,
        micro_rollout_batch_size=cfg.rollout.micro_batch_size,
        value_clip=cfg.critic.value_clip,
        coalesce=engine_coalesces(engine, cfg.ds.coalesce_grad_reduction, name="critic"),
        max_tokens=(cfg.rollout.max_tokens_per_gpu or 0) if cfg.train.dynamic_batch_enable else 0,
    )


def train_engine(cfg: PPOConfig, model: Any, optim: OptimizerFields, optimizer_steps: int) -> Any:
    """The DeepSpeed engine of a trained model (policy: ``cfg.actor``'s optimizer, critic:
    ``cfg.critic``'s); with --lora_rank, of its LoRA adapters (and the critic's value head) only."""
    from learner.runtime import engine as E
    from learner.runtime.lora import apply_lora

    lora = apply_lora(model, cfg.ds.lora, gradient_checkpointing=cfg.actor.gradient_checkpointing_enable)
    return E.make_engine(
        lora,
        **engine_options(cfg.ds, optim),
        # DeepSpeed counts every rank as data parallel: with the sequence split (--ds.ring_attn_size N) its
        # batch is N x the train batch, so that its accumulation steps are a rank's micro-batches per step
        train_batch_size=cfg.train.batch_size * cfg.ds.ring_attn_size,
        micro_train_batch_size=cfg.train.micro_batch_size,
        num_training_steps=max(1, optimizer_steps),
    )


def sample_scoring(cfg: PPOConfig) -> Scoring:
    """How the run's samples get their rewards (``learner/controller/scoring.py``): by a reward
    service, or, with an agent, by their episodes, a reward service asked only for the reference
    (KL) and for the episodes that leave their reward to it (``reward: None``), which needs a
    reward model or function (--reward_pretrain, --remote_rm_url)."""
    if not cfg.train.agent_func_path:
        return ServiceScoring()
    return EpisodeScoring(
        reference=cfg.algo.kl.needed or cfg.distill,
        service_rewards=bool(cfg.reward.model_name_or_path or cfg.reward.remote_url),
    )


def check_reward_sources(cfg: PPOConfig, peers: list) -> None:
    """The learner's flags promise sources (KL needs reference log-probs, --reward_pretrain a
    reward model); fail at start-up, naming the services, if none of them provides one."""
    sources = {
        p.name: set(p.capabilities.sources if isinstance(p.capabilities, RewardCapabilities) else []) for p in peers
    }
    want = []
    if cfg.algo.kl.needed:
        want.append(
            (
                "ref",
                "KL (--init_kl_coef > 0 or --use_kl_loss) needs reference log-probs: start a reward "
                "service with --ref_pretrain",
            )
        )
    if cfg.distill:
        want.append(
            (
                "teacher",
                f"--teacher_pretrain is set (on-policy distillation): start a reward service with --teacher_pretrain "
                f"{cfg.teacher.model_name_or_path}",
            )
        )
    if cfg.reward.model_name_or_path:
        want.append(("rm", "--reward_pretrain is set: start a reward service with --reward_pretrain"))
    for source, why in want:
        if not any(source in s for s in sources.values()):
            raise RunError(f"{why} (connected reward services and their sources: {sources})")
    k = cfg.algo.distill.topk if cfg.distill else 0
    short = {
        p.name: p.capabilities.teacher_topk
        for p in peers
        if isinstance(p.capabilities, RewardCapabilities) and p.capabilities.teacher_topk < k
    }
    if short:
        raise RunError(
            f"--distill_topk {k} needs the teacher's top-{k} from every reward service (reward_service "
            f"--teacher_topk {k}); these serve fewer (their --teacher_topk): {short}"
        )


def rollout_admission(cfg: PPOConfig) -> Callable[[Hello], Error | None]:
    """The pool's check of a rollout server's Hello. In an agent run (``--agent_func_path``) it
    must run the same agent file (name and content hash) and fit a whole episode (``--max_len``);
    under ``--lora_sync adapter`` serve adapters of ``--lora_rank``. A refused server gets no
    work, at start-up (the run stops, naming it) or joining later."""
    want = cfg.agent_params()
    lora_rank = cfg.ds.lora.rank if cfg.services.lora_sync == "adapter" else 0

    def admit(hello: Hello) -> Error | None:
        caps = hello.capabilities
        if hello.role != "rollout":
            return None
        served = caps.max_lora_rank if isinstance(caps, RolloutCapabilities) else 0
        if served < lora_rank:
            return Error(
                code="bad_request",
                message=f"{hello.name} serves LoRA adapters up to rank {served} (0: started without --enable_lora); "
                f"this run pushes a rank-{lora_rank} adapter (--lora_sync adapter): start it with --enable_lora "
                f"--max_lora_rank {lora_rank}, or push merged weights (--lora_sync merged)",
            )
        if want is None:
            return None
        agent = caps.agent if isinstance(caps, RolloutCapabilities) else ""
        if agent != want.agent:
            return Error(
                code="bad_request",
                message=f"{hello.name} runs agent {agent or 'none'}; this run's --agent_func_path "
                f"{cfg.train.agent_func_path} is {want.agent}: start it with the same --agent_func_path",
            )
        if isinstance(caps, RolloutCapabilities) and 0 < caps.max_model_len < want.max_len:
            return Error(
                code="bad_request",
                message=f"{hello.name} has --max_model_len {caps.max_model_len}, below this run's --max_len "
                f"{want.max_len} (an episode: prompt plus every turn): lower --max_len or raise --max_model_len",
            )
        return None

    return admit
