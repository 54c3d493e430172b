"""Set-up pieces of an RL run: the trained engines, the controller, the sampling settings.

Called once by ``learner.rl.run``; each builder takes the resolved ``PPOConfig`` so the flag
-> object mapping lives in one place.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from common.protocol import SamplingParams
from learner.rl.config import PPOConfig

log = logging.getLogger("learner")


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s learner[{rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def sampling_params(cfg: PPOConfig, tokenizer: Any) -> tuple[SamplingParams, SamplingParams]:
    """(training sampling, greedy evaluation sampling)."""
    stop = sorted(i for i in {tokenizer.eos_token_id} if i is not None)
    sampling = SamplingParams(
        n=cfg.n_samples_per_prompt,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.generate_max_len,
        stop_token_ids=stop,
        seed=None,
    )
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.generate_max_len, stop_token_ids=stop)
    return sampling, greedy


def make_controller(cfg: PPOConfig, sampling: SamplingParams, rollout: Any, tokenizer: Any, *, sync_joiners: bool):
    """Rank 0's controller over ``rollout`` (a RolloutClient bound to the controller socket)."""
    from learner.controller.controller import Controller
    from learner.controller.ledger import PromptLedger

    ledger = PromptLedger(generate_timeout_s=cfg.generate_timeout_s, score_timeout_s=cfg.score_timeout_s)
    return Controller(
        rollout,
        ledger,
        sampling=sampling,
        sync_joiners_in_pump=sync_joiners,
        detokenize=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
    )


def critic_save_path(cfg: PPOConfig) -> str:
    """Where --save_value_network writes the critic: next to the policy, as OpenRLHF does."""
    return str(cfg.save_path).rstrip("/") + "_critic"


def make_critic(cfg: PPOConfig, tokenizer: Any, pad_id: int, device: torch.device, optimizer_steps: int) -> Any:
    """The critic's own DeepSpeed engine: same ZeRO stage and batch sizes as the policy."""
    from learner.rl.critic import Critic, load_critic
    from learner.runtime.accumulation import engine_coalesces

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
        coalesce=engine_coalesces(engine, cfg.coalesce_grad_reduction, name="critic"),
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
