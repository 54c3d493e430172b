"""Flags of ``learner.train_ppo``: one config of sections, named as OpenRLHF 0.10 names them.

``--actor.adam.lr`` and the older ``--actor_learning_rate`` are one flag (``common.config``);
each section is ``learner.rl.config.sections``' and checks its own fields, and every rule that
spans sections is here, in ``PPOConfig.__post_init__``. Code that needs one section takes that
section (``cfg.algo``, ``cfg.rollout``); what needs several takes them one by one.

OpenRLHF's Ray placement flags are accepted and explained: here, placement is which processes
you start and where (see README's multi-terminal recipe).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config import flag, section
from learner.algorithms.estimators import ESTIMATORS
from learner.rl.config.sections import (
    ActorSection,
    AgentSection,
    AlgoSection,
    CriticSection,
    DataSection,
    EvalSection,
    PPOCkptSection,
    PPODSSection,
    PPOLoggerSection,
    RefSection,
    RewardSection,
    RolloutSection,
    ServicesSection,
    TeacherSection,
    TrainSection,
    VLLMSection,
)
from learner.runtime.flags import OPTIMIZER_FLAT, AdamSection

__all__ = ["PPOConfig", "ENGINE_FLAGS"]

# OpenRLHF passes these to the vLLM engines it creates; here each rollout_service is started
# with its own engine flags (launch.local and the Slurm scripts pass them on).
ENGINE_FLAGS = {"vllm.enforce_eager": "--enforce_eager", "vllm.tensor_parallel_size": "--tensor_parallel_size"}

# RL keeps its own optimizer defaults: a constant LR without warm-up (the seed's, and what the
# demo's figures were measured with), where OpenRLHF 0.10 warms up 3 % then decays by cosine.
_RL_OPTIM = {"lr_scheduler": "constant_with_warmup", "lr_warmup_ratio": 0.0}


@dataclass
class PPOConfig:
    """Every flag of ``learner.train_ppo``, by section. Checks that rewrite a flag (a default
    switched to fit another flag, a flag that cannot act) do not log while the flags parse,
    before logging is set up and on every rank: they are kept in ``notices``, which the run
    logs once, on rank 0 (``learner.rl.run.init_process``)."""

    actor: ActorSection = section(
        ActorSection,
        "the policy: model, optimizer (AdamW), loss",
        flat={**OPTIMIZER_FLAT, "adam.lr": "actor_learning_rate"},
        defaults=_RL_OPTIM,
    )
    critic: CriticSection = section(
        CriticSection,
        "the critic (--algo.advantage.estimator gae)",
        flat={**OPTIMIZER_FLAT, "adam.lr": "critic_learning_rate"},
        defaults={**_RL_OPTIM, "adam": lambda: AdamSection(lr=9e-6)},
    )
    ref: RefSection = section(RefSection, "the reference model (KL)")
    teacher: TeacherSection = section(TeacherSection, "the teacher (on-policy distillation)")
    reward: RewardSection = section(RewardSection, "rewards and their shaping")
    rollout: RolloutSection = section(RolloutSection, "generation: batch sizes and sampling")
    train: TrainSection = section(TrainSection, "the training loop and its schedule")
    algo: AlgoSection = section(AlgoSection, "advantages, KL, dynamic filtering")
    ds: PPODSSection = section(PPODSSection, "DeepSpeed and numerics")
    vllm: VLLMSection = section(VLLMSection, "the rollout engines, as the learner sees them")
    ckpt: PPOCkptSection = section(
        PPOCkptSection, "checkpoints and the final model", defaults={"output_dir": "./ckpt/ppo"}
    )
    logger: PPOLoggerSection = section(PPOLoggerSection, "metrics")
    eval: EvalSection = section(EvalSection, "held-out evaluation")
    data: DataSection = section(DataSection, "the prompts")
    agent: AgentSection = section(AgentSection, "multi-turn agents (rayless's own)")
    services: ServicesSection = section(ServicesSection, "processes and the wire (rayless's own)")
    local_rank: int = flag(-1, "set by the deepspeed launcher", inert="the rank comes from the environment (torchrun)")
    use_ms: bool = flag(False, "ModelScope hub", inert="no hub is reached at run time: pass local paths")
    notices: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def given_notices(self, given: Mapping[str, Any]) -> list[str]:
        """Lines about flags given that these values leave without effect (common.config asks)."""
        return self.actor.unused_muon(given, "actor.") + self.critic.unused_muon(given, "critic.")

    def __post_init__(self) -> None:
        self.notices = []  # common.config puts the inert flags' lines first
        if not self.ds.lora.rank and self.services.lora_sync != "merged":
            self.notices.append(f"--lora_sync {self.services.lora_sync} has no effect without --lora_rank")
        self._check_batches()
        self._check_dynamic_batch()
        self._check_agent()
        self._check_logging()
        self._check_async()
        self._check_colocate()
        self._check_algorithm()
        self._check_distill()
        if self.reward.normalize_enable and not self.reward.model_name_or_path:
            # OpenRLHF scripts carry it with rule rewards too; it concerns a reward model's scores
            # and a critic's values (by the mean/std saved in their configs), nothing else.
            self.notices.append(
                "--normalize_reward normalises a reward model's scores and a critic's values by the mean/std saved "
                "in their configs, not running statistics; without --reward_pretrain "
                + (
                    f"it acts only if the critic's config ({self.critic_path}) carries a reward model's mean/std"
                    if self.needs_critic
                    else "and without a critic it does nothing"
                )
            )

    # ------------------------------------------------------------------ rules across sections
    def _check_batches(self) -> None:
        spec = ESTIMATORS[self.algo.advantage.estimator]
        g = self.rollout.n_samples_per_prompt
        if g < spec.min_group:
            raise ValueError(
                f"--advantage_estimator {spec.name} compares samples of one prompt: "
                f"needs --n_samples_per_prompt >= {spec.min_group}, got {g}"
            )
        samples = self.rollout.batch_size * g
        if samples % self.train.batch_size:
            raise ValueError(
                f"rollout_batch_size x n_samples_per_prompt = {samples} samples per step must be a "
                f"multiple of --train_batch_size {self.train.batch_size}"
            )

    def _check_agent(self) -> None:
        if not self.data.max_len:
            self.data.max_len = self.data.prompt_max_len + self.rollout.max_new_tokens
        if not self.train.agent_func_path:
            return
        from common.agent_file import check_agent_path

        check_agent_path(self.train.agent_func_path)  # a .py file or a hub environment (gem:ENV_ID)
        self.agent_params()  # the file is read now: a missing one fails here, naming the flag
        # A reward model or function scores only the episodes that return reward None (docs/agents.md).
        scorer = self.reward.model_name_or_path or self.reward.remote_url
        teacher = self.teacher.model_name_or_path
        if not self.algo.kl.needed and not teacher and not scorer and self.services.min_reward_services:
            self.services.min_reward_services = 0
            self.notices.append(
                "--agent_func_path without KL: the agent scores its episodes, no reward service is waited for "
                "(an episode that returns reward None then fails: give --reward_pretrain or --remote_rm_url to score it)"
            )

    def _check_logging(self) -> None:
        """Evaluation and the checkpoint flags that go with it."""
        if self.eval.temperature == 0 and self.eval.n_samples_per_prompt > 1:
            self.notices.append(
                f"--eval_temperature 0 is greedy: the {self.eval.n_samples_per_prompt} samples of each evaluation "
                "prompt are the same answer, so pass@n equals pass@1 (--eval_n_samples_per_prompt 1 costs less)"
            )
        key = self.ckpt.best_metric_key
        explicit_best = key not in ("", "none")
        if explicit_best and not self.eval.dataset:
            raise ValueError(f"--best_metric_key {key} ranks checkpoints by an evaluation: it needs --eval_dataset")
        steps, save = self.eval.steps, self.ckpt.save_steps
        if explicit_best and save and (steps < 0 or steps % save):
            # A checkpoint is ranked by the evaluation of its own weights, at its own step.
            self.notices.append(
                f"--best_metric_key ranks a checkpoint by the evaluation at its step, but with --eval_steps "
                f"{steps} and --save_steps {save} some evaluations have no checkpoint to keep: "
                "make --eval_steps a multiple of --save_steps"
            )

    def _check_async(self) -> None:
        """--async_train's flags, and the IS correction it defaults (``auto`` resolves here)."""
        adv = self.algo.advantage
        if not self.train.async_enable:
            if self.train.max_staleness != 1:
                raise ValueError("--max_staleness bounds the async schedule's lag: it needs --async_train")
            adv.is_correction = "" if adv.is_correction in ("auto", "none") else adv.is_correction
            return
        if adv.is_correction == "":
            # Samples are up to K versions old: without a correction the update is biased by the lag.
            raise ValueError(
                "--async_train trains on samples from older weights and needs --is_correction "
                "(default tis); pass --is_correction none to train without one"
            )
        if adv.is_correction == "none":
            self.notices.append("--async_train with --is_correction none: no importance correction for the policy lag")
            adv.is_correction = ""
        elif adv.is_correction == "auto":
            adv.is_correction = "tis"

    def _check_dynamic_batch(self) -> None:
        """--train.dynamic_batch_enable and its two budgets (OpenRLHF's meanings): the no-grad
        passes' budget defaults to the training one, as OpenRLHF sets it."""
        rollout, train = self.rollout, self.train
        if train.dynamic_batch_enable:
            if rollout.max_tokens_per_gpu is None:
                rollout.max_tokens_per_gpu = train.max_tokens_per_gpu
            return
        default = {leaf.name: leaf.default for leaf in dataclasses.fields(train)}["max_tokens_per_gpu"]
        if rollout.max_tokens_per_gpu is not None or train.max_tokens_per_gpu != default:
            self.notices.append(
                "--train.max_tokens_per_gpu / --rollout.max_tokens_per_gpu are token budgets of micro-batches: they "
                "act only with --train.dynamic_batch_enable (micro-batches of --train.micro_batch_size samples now)"
            )

    def _check_colocate(self) -> None:
        """--colocate_all_models and its sleep flags (OpenRLHF's meanings, docs/colocated.md)."""
        if self.train.colocate_all and self.train.async_enable:
            # Colocated engines sleep while the learner trains; async keeps them generating then.
            raise ValueError(
                "--colocate_all_models and --async_train contradict each other: colocated engines and learner "
                "take turns on the same GPUs, async generates while training; drop one of them"
            )
        if self.train.async_enable and self.vllm.enable_sleep:
            raise ValueError("--vllm_enable_sleep makes the engines sleep while training: not with --async_train")
        for name, holder in (("vllm_enable_sleep", self.vllm), ("deepspeed_enable_sleep", self.ds)):
            if holder.enable_sleep and not self.train.colocate_all:
                # As OpenRLHF: without colocation nothing else wants the memory, so the flag is off.
                self.notices.append(f"--{name} acts only with --colocate_all_models: turned off")
                holder.enable_sleep = False

    def _check_algorithm(self) -> None:
        """Flag combinations that would fail deep inside a step, refused at parse time."""
        actor, adv = self.actor, self.algo.advantage
        if actor.policy_loss_type == "gspo" and actor.loss_agg_mode != "seq_mean_token_mean":
            # GSPO's ratio is per sequence, so its loss is a mean over sequences. The default
            # token_mean is switched (the user did not ask for anything else); an explicit
            # other sequence mode is a contradiction and refused.
            if actor.loss_agg_mode != "token_mean":
                raise ValueError(
                    f"--policy_loss_type gspo needs --loss_agg_mode seq_mean_token_mean, got {actor.loss_agg_mode}"
                )
            self.notices.append(
                "--policy_loss_type gspo: using --loss_agg_mode seq_mean_token_mean (GSPO's loss is a "
                "mean over sequences)"
            )
            actor.loss_agg_mode = "seq_mean_token_mean"
        if adv.is_correction:
            if len(adv.is_correction_threshold) != 2:
                raise ValueError(
                    f"--is_correction_low_high takes two numbers (low high), got {adv.is_correction_threshold}"
                )
            low, high = adv.is_correction_threshold
            if not (0 <= low < 1 < high):
                raise ValueError(
                    f"--is_correction {adv.is_correction}: thresholds must satisfy "
                    f"0 <= low < 1 < high (a ratio of 1 must pass), got {low} {high}"
                )
        if self.algo.dynamic_filtering_enable and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                "--dynamic_filtering drops groups whose rewards are all equal: needs "
                f"--n_samples_per_prompt >= 2, got {self.rollout.n_samples_per_prompt}"
            )
        spec = ESTIMATORS[adv.estimator]
        if spec.needs_critic:
            if adv.gamma <= 0 or adv.gamma > 1 or adv.lambd < 0 or adv.lambd > 1:
                raise ValueError(f"--gamma must be in (0, 1] and --lambd in [0, 1], got {adv.gamma} {adv.lambd}")
            if self.critic.adam.lr <= 0:
                raise ValueError(f"--critic_learning_rate must be > 0, got {self.critic.adam.lr}")
            return
        if self.critic.freezing_steps >= 0:
            raise ValueError("--freezing_actor_steps warms up a critic: only with --advantage_estimator gae")
        if self.critic.save_value_network:
            raise ValueError(
                f"--save_value_network saves the critic, and --advantage_estimator {adv.estimator} has none: only "
                "with --advantage_estimator gae"
            )
        if adv.gamma != 1.0 and not spec.any_gamma:
            raise ValueError(
                f"--advantage_estimator {adv.estimator} uses a group baseline: --gamma must be 1, got {adv.gamma}"
            )

    def _check_distill(self) -> None:
        d = self.algo.distill
        if not self.teacher.model_name_or_path:
            for name, given, default in (("distill_topk", d.topk, 0), ("distill_jsd_beta", d.jsd_beta, 1.0)):
                if given != default:
                    raise ValueError(f"--{name} is a setting of on-policy distillation: give --teacher_pretrain")
            return
        if d.topk and self.ds.ring_attn_size > 1:
            raise ValueError(
                f"--distill_topk {d.topk} is not built for a sequence split over ranks (--ds.ring_attn_size "
                f"{self.ds.ring_attn_size}): use the sampled-token mode, --distill_topk 0"
            )
        if d.coef == 0:
            self.notices.append("--distill_coef 0: the teacher's reverse KL is measured and logged, not trained on")

    # ------------------------------------------------------------------ derived
    @property
    def distill(self) -> bool:
        """On-policy distillation: a teacher's log-probs on every sample (reward services with
        --teacher_pretrain)."""
        return bool(self.teacher.model_name_or_path)

    @property
    def needs_critic(self) -> bool:
        return ESTIMATORS[self.algo.advantage.estimator].needs_critic

    @property
    def critic_path(self) -> str:
        return self.critic.model_name_or_path or self.reward.model_name_or_path or self.actor.model_name_or_path

    def check_world_size(self, world: int) -> None:
        """Run-time checks that need the number of learner ranks (called by learner.rl.run)."""
        t = self.train
        split = self.ds.ring_attn_size
        if world % split:
            raise ValueError(f"--ds.ring_attn_size {split} must divide the {world} learner ranks")
        # With the sequence split, each group of ring_attn_size ranks is one data-parallel rank (OpenRLHF's meaning)
        dp = world // split
        ranks = f"{dp} data-parallel ranks ({world} learner ranks / --ds.ring_attn_size {split})" if split > 1 else ""
        ranks = ranks or f"{world} learner ranks"
        if t.batch_size % (t.micro_batch_size * dp):
            raise ValueError(
                f"--train_batch_size {t.batch_size} must be a multiple of --micro_train_batch_size {t.micro_batch_size} "
                f"x {ranks}"
            )
        if self.rollout.batch_size % dp:
            raise ValueError(f"--rollout_batch_size {self.rollout.batch_size} must be divisible by the {ranks}")

    def agent_params(self) -> Any:
        """The ``AgentParams`` every prompt batch carries, or None without an agent."""
        if not self.train.agent_func_path:
            return None
        from common.agent_file import agent_identity
        from common.protocol import AgentParams

        return AgentParams(
            agent=agent_identity(self.train.agent_func_path),
            max_len=self.data.max_len,
            max_turns=self.agent.max_turns,
            step_timeout_s=self.agent.step_timeout_s,
        )

    def engine_flags_used(self) -> list[tuple[str, str]]:
        """(learner flag, rollout_service flag) of vLLM engine flags given to the learner."""
        from common.config import get

        return [(name, ENGINE_FLAGS[name]) for name in ENGINE_FLAGS if get(self, name)]
