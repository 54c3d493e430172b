"""The sections of ``learner.train_ppo``'s config, named as OpenRLHF 0.10 names them.

Each flag answers to its dotted name (``--algo.kl.init_coef``) and to the flat name of the
older releases declared next to it (``--init_kl_coef``). Flags OpenRLHF has and rayless cannot
act on are accepted and marked ``inert``: setting one is said at start-up in one line. Checks
inside one section live in its ``__post_init__``; rules that span sections live in one place,
``learner.rl.config.PPOConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import flag, section
from common.weights import known_backends
from learner.algorithms.estimators import ESTIMATORS, estimator_help
from learner.runtime.checkpoint_config import CkptSection
from learner.runtime.flags import DSSection, OptimizerFields
from learner.runtime.tracking import LoggerSection

_RAY = "Ray placement; rayless places nothing, the processes you start are the placement: "


@dataclass
class ActorSection(OptimizerFields):
    """The policy: its model, optimizer and loss."""

    model_name_or_path: str = flag("", "policy model: HF hub name or local path", required=True, flat="pretrain")
    gradient_checkpointing_enable: bool = flag(
        False, "recompute activations in backward to save memory", flat="gradient_checkpointing"
    )
    policy_loss_type: str = flag(
        "ppo", "ppo (token ratio) or gspo (sequence ratio)", choices=("ppo", "gspo"), flat="policy_loss_type"
    )
    loss_agg_mode: str = flag(
        "token_mean",
        "how per-token losses are averaged",
        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"),
        flat="loss_agg_mode",
    )
    eps_clip: float = flag(0.2, "PPO clip range", flat="eps_clip")
    eps_clip_low_high: list[float] = flag(
        [], "asymmetric clip (low high), e.g. 0.2 0.28 (clip-higher)", flat="eps_clip_low_high"
    )
    dual_clip: float = flag(0.0, "dual-clip constant c > 1 (0: off)", flat="dual_clip")
    entropy_coef: float = flag(
        0.0,
        "entropy bonus coefficient (with 0, entropy is still logged every --logger.logging_steps)",
        flat="entropy_loss_coef",
    )
    num_nodes: int = flag(
        1, "Ray placement", flat="actor_num_nodes", inert=_RAY + "torchrun --nnodes/--nproc_per_node for the learner"
    )
    num_gpus_per_node: int = flag(
        8,
        "Ray placement",
        flat="actor_num_gpus_per_node",
        inert=_RAY + "torchrun --nnodes/--nproc_per_node for the learner",
    )
    gradient_checkpointing_reentrant: bool = flag(
        False, "reentrant checkpointing", inert="rayless uses non-reentrant checkpointing (torch's recommendation)"
    )
    aux_loss_coef: float = flag(0.0, "MoE balancing loss", inert="MoE balancing losses are not built in rayless")
    freeze_visual_encoder: bool = flag(False, "freeze a VLM's vision tower", inert="vision is issue 42, not built yet")

    def __post_init__(self) -> None:
        self.check_optimizer("actor.")
        if self.eps_clip_low_high:
            if len(self.eps_clip_low_high) != 2:
                raise ValueError(f"--eps_clip_low_high takes two numbers (low high), got {self.eps_clip_low_high}")
            low, high = self.eps_clip_low_high
            if not (0 <= low < 1 and high >= 0):
                raise ValueError(f"--eps_clip_low_high: need 0 <= low < 1 and high >= 0, got {low} {high}")
        if not 0 <= self.eps_clip < 1:
            raise ValueError(f"--eps_clip must be in [0, 1), got {self.eps_clip}")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"--dual_clip must be > 1 (or 0: off), got {self.dual_clip}")

    @property
    def clip_low_high(self) -> tuple[float, float]:
        if self.eps_clip_low_high:
            return float(self.eps_clip_low_high[0]), float(self.eps_clip_low_high[1])
        return self.eps_clip, self.eps_clip


@dataclass
class CriticSection(OptimizerFields):
    """The critic (--algo.advantage.estimator gae)."""

    model_name_or_path: str = flag(
        "",
        "critic: default --reward.model_name_or_path if set, else the policy's; its value head is the checkpoint's "
        "tensor named by its config's value_head_prefix, else by --ds.value_head_prefix; without one, a fresh head",
        flat="critic_pretrain",
    )
    value_clip: float = flag(0.5, "critic value clipping around the old values (<= 0: off; gae)", flat="value_clip")
    freezing_steps: int = flag(
        -1,
        "critic-only warm-up (gae): the policy is not updated while the step, counted from 0, is <= N, i.e. "
        "for the first N + 1 rollout steps, as OpenRLHF counts (negative: off)",
        flat="freezing_actor_steps",
    )
    save_value_network: bool = flag(
        False, "also write the trained critic (gae) in HF format to OUTPUT_DIR_critic", flat="save_value_network"
    )
    num_nodes: int = flag(
        1, "Ray placement", flat="critic_num_nodes", inert=_RAY + "the critic trains on the learner's ranks"
    )
    num_gpus_per_node: int = flag(
        8, "Ray placement", flat="critic_num_gpus_per_node", inert=_RAY + "the critic trains on the learner's ranks"
    )

    def __post_init__(self) -> None:
        self.check_optimizer("critic.")


@dataclass
class RefSection:
    """The reference model (KL), served by reward services."""

    model_name_or_path: str = flag(
        "",
        "reference model for KL: served by reward_service --ref_pretrain (launch.local passes it on, default the "
        "policy's when KL is on)",
        flat="ref_pretrain",
    )
    num_nodes: int = flag(
        1, "Ray placement", flat="ref_num_nodes", inert=_RAY + "start reward_service processes yourself"
    )
    num_gpus_per_node: int = flag(
        8, "Ray placement", flat="ref_num_gpus_per_node", inert=_RAY + "start reward_service processes yourself"
    )
    offload: bool = flag(False, "reference model on CPU", inert="the reference lives in its reward service")


@dataclass
class TeacherSection:
    """The teacher of on-policy distillation (docs/distillation.md), served by reward services."""

    model_name_or_path: str = flag(
        "",
        "teacher for on-policy distillation: its log-probs on the student's own samples, served by reward_service "
        "--teacher_pretrain (launch.local passes it on); it must share the policy's tokenizer (checked at start-up)",
        flat="teacher_pretrain",
    )


@dataclass
class RewardSection:
    """Rewards: a reward model or functions (served by reward services), and their shaping."""

    model_name_or_path: str = flag(
        "",
        "reward model: served by reward_service (launch.local passes it on); the learner checks a connected "
        "reward service scores with a reward model",
        flat="reward_pretrain",
    )
    remote_url: str = flag(
        "",
        "reward function file (reward_func.py) or HTTP reward URL(s), comma-separated: served by reward_service "
        "--remote_rm_url (launch.local passes it on)",
        flat="remote_rm_url",
    )
    normalize_enable: bool = flag(
        False,
        "OpenRLHF's reward normalisation, by the statistics saved with a model, never running ones: the reward "
        "service serves (r - mean) / std with the reward model's config.json mean/std (launch.local passes it "
        "on), and the critic (gae) gives (V - mean) / std with its own config's, when it has them",
        flat="normalize_reward",
    )
    clip_range: list[float] = flag([-10.0, 10.0], "clip rewards to [low, high]", flat="reward_clip_range")
    overlong_buffer_len: int = flag(
        0, "DAPO overlong penalty window (tokens before the max length; 0: off)", flat="overlong_buffer_len"
    )
    overlong_penalty_factor: float = flag(
        1.0, "DAPO overlong penalty at the max length", flat="overlong_penalty_factor"
    )
    stop_properly_penalty_coef: float | None = flag(
        None,
        "ProRL stop-properly penalty on samples cut at the length limit (finish_reason length): >= 0 (at most 1) "
        "scales their reward by it, < 0 replaces their reward with it (e.g. -0.5); unset: off",
        flat="stop_properly_penalty_coef",
    )
    num_nodes: int = flag(
        1, "Ray placement", flat="reward_num_nodes", inert=_RAY + "start reward_service processes yourself"
    )
    num_gpus_per_node: int = flag(
        8, "Ray placement", flat="reward_num_gpus_per_node", inert=_RAY + "start reward_service processes yourself"
    )
    offload: bool = flag(False, "reward model on CPU", inert="the reward model lives in its reward service")

    def __post_init__(self) -> None:
        if self.clip_range and (len(self.clip_range) != 2 or self.clip_range[0] >= self.clip_range[1]):
            raise ValueError(f"--reward_clip_range takes two numbers low < high, got {self.clip_range}")
        coef = self.stop_properly_penalty_coef
        if coef is not None and coef > 1:
            raise ValueError(
                f"--stop_properly_penalty_coef must be in [0, 1] (a scale) or negative (a fixed reward), got {coef}"
            )


@dataclass
class RolloutSection:
    """Generation: batch sizes and sampling (the rollout servers sample)."""

    batch_size: int = flag(512, "prompts per rollout step", flat="rollout_batch_size")
    n_samples_per_prompt: int = flag(1, "samples per prompt (the group size G)", flat="n_samples_per_prompt")
    micro_batch_size: int = flag(
        8, "samples per forward pass when computing log-probs", flat="micro_rollout_batch_size"
    )
    max_new_tokens: int = flag(1024, "max new tokens per sample", flat="generate_max_len")
    temperature: float = flag(1.0, "sampling temperature", flat="temperature")
    top_p: float = flag(1.0, "nucleus sampling", flat="top_p")
    top_k: int = flag(-1, "top-k sampling (-1: off)", flat="top_k")
    seed_sampling: bool = flag(
        False,
        "sample each prompt with its own seed, from --seed and the prompt's place in the run (its stream "
        "position; a dynamic-filtering refill: its step and draw), on whichever server and retry: a run samples "
        "what a run with the same flags sampled, and a run resumed from a checkpoint what the uninterrupted run "
        "did (vLLM keeps a generator per seeded request: a little slower sampling on GPUs)",
        flat="seed_sampling",
    )
    vllm_generate_batch_size: int = flag(
        0, "prompts per vLLM call", inert="each rollout server admits what it can hold (its engine schedules)"
    )
    max_tokens_per_gpu: int | None = flag(
        None,
        "with --train.dynamic_batch_enable: tokens per micro-batch of the passes without gradients (the learner's "
        "old log-probs and the critic's old values on each rank; the reward services' reference and reward-model "
        "forwards, launch.local passes it on as their --max_tokens_per_gpu); default: --train.max_tokens_per_gpu",
        flat="rollout_max_tokens_per_gpu",
    )

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise ValueError(f"--rollout.max_tokens_per_gpu must be >= 1, got {self.max_tokens_per_gpu}")


@dataclass
class TrainSection:
    """The training loop: batch sizes, run length, the schedule."""

    batch_size: int = flag(128, "samples per optimizer step (global)", flat="train_batch_size")
    micro_batch_size: int = flag(8, "samples per forward/backward pass per rank", flat="micro_train_batch_size")
    max_epochs: int = flag(1, "passes over each rollout batch", flat="max_epochs")
    num_episodes: int = flag(1, "passes over the prompt dataset", flat="num_episodes")
    max_steps: int = flag(0, "stop after this many rollout steps (0: no limit)", flat="max_steps")
    seed: int = flag(42, "seed of data order and initialisation", flat="seed")
    recompute_old_logprobs: bool = flag(
        False,
        "always run the no-grad old-log-probs forward; by default an on-policy rollout trained by one optimizer "
        "step in one epoch takes them from the training forward (the same values)",
        flat="recompute_old_logprobs",
    )
    async_enable: bool = flag(
        False,
        "async (off-policy) schedule: rollout servers keep generating while the learner trains; weights are "
        "pushed after every step without stopping generation",
        flat="async_train",
    )
    max_staleness: int = flag(
        1,
        "--train.async_enable: every trained sample was started by weights at most this many versions behind "
        "the ones being trained (0: lockstep's samples, on-policy)",
        flat="max_staleness",
    )
    colocate_all: bool = flag(
        False,
        "colocated lockstep schedule: learner ranks and rollout engines share the same GPUs and take turns "
        "(start them on the same devices: launch.local and launch/grpo_colocated.slurm do)",
        flat="colocate_all_models",
    )
    agent_func_path: str = flag(
        "",
        "an agent file (OpenRLHF's AgentExecutor contract, or an 'async def agent_func(client, prompt, label)' "
        "written against the OpenAI API): every prompt runs as a multi-turn episode on the rollout servers, which "
        "load the same file (launch.local passes it on); the agent's rewards are the reward (docs/agents.md). "
        "'gem:ENV_ID[?key=value&...]' plays a GEM environment instead (docs/environments.md)",
        flat="agent_func_path",
    )
    colocate_actor_ref: bool = flag(
        False, "Ray placement", flat="colocate_actor_ref", inert=_RAY + "the reference lives in a reward service"
    )
    colocate_critic_reward: bool = flag(
        False, "Ray placement", flat="colocate_critic_reward", inert=_RAY + "the critic trains on the learner's ranks"
    )
    async_queue_size: int = flag(
        1, "async queue size", inert="rayless bounds the async lag by versions: --train.max_staleness"
    )
    partial_rollout_enable: bool = flag(
        False,
        "async: weights change under in-flight requests",
        inert="rayless's async schedule always keeps in-flight requests across a push (docs/async.md)",
    )
    enable_ema: bool = flag(
        False,
        "also keep an exponential moving average of the policy's trained weights (LoRA: the adapter), updated "
        "after every optimizer step (fp32, 1/N per rank in host memory) and kept in checkpoints; the final EMA "
        "model goes to --ckpt.output_dir, where OpenRLHF writes it, the trained policy to OUTPUT_DIR_trained "
        "(--save_hf_ckpt: a checkpoint's hf/ and hf_trained/); rollout servers get the trained weights",
        flat="enable_ema",
    )
    ema_beta: float = flag(
        0.992, "--train.enable_ema's decay: ema = beta * ema + (1 - beta) * weights, in (0, 1)", flat="ema_beta"
    )
    dynamic_batch_enable: bool = flag(
        False,
        "micro-batches formed by a token budget instead of a sample count, in every learner pass (policy, old "
        "log-probs, critic) and the reward services' forwards: each rank's samples grouped so that each micro-batch's "
        "tokens (prompt + response, counted as padded without --packing_samples) fit --train.max_tokens_per_gpu "
        "(--rollout.max_tokens_per_gpu without gradients), a longer sample alone; the loss and gradients are those of "
        "fixed micro-batches (--train.micro_batch_size then only sets DeepSpeed's accumulation steps)",
        flat="use_dynamic_batch",
    )
    max_tokens_per_gpu: int = flag(
        16192,
        "with --train.dynamic_batch_enable: tokens per training micro-batch (forward and backward) on each rank",
        flat="train_max_tokens_per_gpu",
    )
    full_determinism_enable: bool = flag(
        False,
        "reproducible training: --seed seeds python, numpy and torch (as always) and torch runs deterministic "
        "kernels only (torch.use_deterministic_algorithms, cuDNN deterministic, cuBLAS workspace, "
        "FLASH_ATTENTION_DETERMINISTIC), as OpenRLHF's transformers.enable_full_determinism; slower on GPUs",
        flat="full_determinism",
    )

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_tokens_per_gpu < 1:
            raise ValueError(f"--train.max_tokens_per_gpu must be >= 1, got {self.max_tokens_per_gpu}")
        if not 0 < self.ema_beta < 1:  # 1 never moves, 0 is the trained weights: neither is an average
            raise ValueError(f"--ema_beta must be in (0, 1), got {self.ema_beta}")
        if self.num_episodes < 1:
            raise ValueError(f"--num_episodes must be >= 1, got {self.num_episodes}")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"--train_batch_size {self.batch_size} must be a multiple of "
                f"--micro_train_batch_size {self.micro_batch_size}"
            )


@dataclass
class AdvantageSection:
    """The advantage estimator, its discount, and the importance correction."""

    estimator: str = flag(
        "gae", f"advantage estimator ({estimator_help()})", choices=tuple(ESTIMATORS), flat="advantage_estimator"
    )
    no_std_norm: bool = flag(False, "group_norm without dividing by the group std", flat="no_advantage_std_norm")
    gamma: float = flag(1.0, "discount", flat="gamma")
    lambd: float = flag(1.0, "GAE lambda", flat="lambd")
    is_correction: str = flag(
        "auto",
        "importance correction against the sampler's log-probs (vLLM mismatch; with --async_train also the "
        "policy lag): tis | icepop | seq_mask_tis | none (off) | auto (tis with --async_train, else off)",
        choices=("auto", "none", "", "tis", "icepop", "seq_mask_tis"),
        flat="is_correction",
    )
    is_correction_enable: bool = flag(
        False, "OpenRLHF 0.10's switch of the importance correction: turns on --algo.advantage.is_correction_type"
    )
    is_correction_type: str = flag(
        "tis",
        "OpenRLHF 0.10's correction type (with --algo.advantage.is_correction_enable)",
        choices=("tis", "icepop", "seq-mask-tis", "seq_mask_tis"),
    )
    is_correction_threshold: list[float] = flag(
        [0.0, 2.0],
        "IS ratio thresholds (low high): tis truncates at high; icepop keeps ratios in [low, high]; "
        "seq_mask_tis zeroes a sequence whose geometric-mean ratio leaves [low, high]",
        flat="is_correction_low_high",
    )

    def __post_init__(self) -> None:
        if self.is_correction_enable:
            wanted = self.is_correction_type.replace("-", "_")
            if self.is_correction not in ("auto", wanted):
                raise ValueError(
                    f"--algo.advantage.is_correction_type {self.is_correction_type} and --is_correction "
                    f"{self.is_correction} disagree: give one"
                )
            self.is_correction = wanted
            self.is_correction_enable = False  # resolved into is_correction: re-validating keeps it


@dataclass
class KLSection:
    """KL control against the reference model."""

    init_coef: float = flag(
        0.01, "KL coefficient (in the reward, or of the loss with --use_kl_loss)", flat="init_kl_coef"
    )
    target: float = flag(0.0, "adaptive KL controller target (0: fixed coefficient)", flat="kl_target")
    horizon: int = flag(10000, "adaptive KL controller horizon", flat="kl_horizon")
    use_loss: bool = flag(False, "KL as a loss term instead of in the reward", flat="use_kl_loss")
    estimator: str = flag("k1", "KL estimator", choices=("k1", "k2", "k3"), flat="kl_estimator")

    @property
    def needed(self) -> bool:
        return self.use_loss or self.init_coef > 0


@dataclass
class DistillSection:
    """On-policy distillation against --teacher_pretrain (learner.algorithms.distill)."""

    coef: float = flag(
        1.0,
        "weight of the distillation term: coef * -(log pi - log teacher) added to each token's advantage (to its "
        "reward under gae); with task rewards, their mix",
        flat="distill_coef",
    )
    center: bool = flag(
        True,
        "subtract the batch's mean of the term over its trained tokens (a constant baseline: the same expected "
        "gradient, less noise); --no-distill_center: the published recipe's raw term",
        flat="distill_center",
    )
    topk: int = flag(
        0,
        "0: the sampled-token reverse KL (the published recipe); K > 0: the teacher's top-K log-probs per position "
        "against the student's over the same ids (GKD's JSD(beta), a loss term instead of the advantage term); the "
        "reward services need --teacher_topk >= K (launch.local passes it)",
        flat="distill_topk",
    )
    jsd_beta: float = flag(
        1.0, "--distill_topk's divergence: 1 reverse KL, 0 forward KL, else GKD's JSD(beta)", flat="distill_jsd_beta"
    )

    def __post_init__(self) -> None:
        if not self.coef >= 0:
            raise ValueError(f"--distill_coef must be >= 0, got {self.coef}")
        if self.topk < 0:
            raise ValueError(f"--distill_topk must be >= 0 (0: the sampled token), got {self.topk}")
        if not 0 <= self.jsd_beta <= 1:
            raise ValueError(f"--distill_jsd_beta must be in [0, 1], got {self.jsd_beta}")


@dataclass
class AlgoSection:
    """Estimator, KL and dynamic filtering."""

    advantage: AdvantageSection = section(AdvantageSection, "the advantage estimator and importance correction")
    kl: KLSection = section(KLSection, "KL control")
    distill: DistillSection = section(DistillSection, "on-policy distillation against --teacher_pretrain")
    dynamic_filtering_enable: bool = flag(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and collect more prompts to refill the batch",
        flat="dynamic_filtering",
    )
    dynamic_filtering_range: list[float] = flag(
        [],
        "also drop groups whose mean reward is outside the open interval (low high), e.g. 0 1",
        flat="dynamic_filtering_reward_range",
    )
    dynamic_filtering_max_collects: int = flag(
        4,
        "extra collects per step to refill a filtered batch; then train on what was kept (a warning)",
        flat="dynamic_filtering_max_collects",
    )

    def __post_init__(self) -> None:
        r = self.dynamic_filtering_range
        if r and (len(r) != 2 or r[0] >= r[1]):
            raise ValueError(f"--dynamic_filtering_reward_range takes two numbers low < high, got {r}")


@dataclass
class PPODSSection(DSSection):
    """DeepSpeed, as every trainer has it, plus the colocated schedule's offload."""

    enable_sleep: bool = flag(
        False,
        "--train.colocate_all: DeepSpeed offloads optimizer states and gradients to host memory while the "
        "engines generate (offload_states / reload_states); GPU with a ZeRO optimizer only",
        flat="deepspeed_enable_sleep",
    )


@dataclass
class VLLMSection:
    """The rollout engines, as the learner sees them (each rollout_service has its own engine flags)."""

    sync_backend: str = flag(
        "auto",
        "weight push: auto (nccl on GPUs, gloo on CPUs) | nccl | gloo",
        choices=tuple(known_backends()),
        flat="weight_sync_backend",
        aliases=("--vllm_sync_backend",),
    )
    enable_sleep: bool = flag(
        False,
        "--train.colocate_all: rollout engines sleep (vLLM sleep mode) while the learner trains and wake to "
        "generate; the servers need --enable_sleep (launch.local passes it on); GPU only",
        flat="vllm_enable_sleep",
    )
    gpu_memory_utilization: float | None = flag(
        None,
        "share of each GPU the rollout engines should take (launch.local passes it to rollout_service "
        "--gpu_memory_utilization; the learner checks what the servers announce); unset: the servers' own",
        flat="vllm_gpu_memory_utilization",
    )
    enforce_eager: bool = flag(
        False,
        "vLLM engine flag: pass --enforce_eager to rollout_service (launch.local passes it on)",
        flat="enforce_eager",
    )
    num_engines: int = flag(
        0,
        "rollout servers (launch.local starts this many; by hand: start that many rollout_service processes)",
        flat="vllm_num_engines",
    )
    tensor_parallel_size: int = flag(
        0,
        "vLLM tensor parallel size: rollout_service --tensor_parallel_size (launch.local passes it on)",
        flat="vllm_tensor_parallel_size",
    )
    sync_with_ray: bool = flag(False, "weights over Ray", inert="rayless has no Ray: weights go over torch.distributed")
    enable_prefix_caching: bool = flag(
        False, "vLLM prefix caching", inert="a rollout_service flag: each server's engine keeps vLLM's default"
    )

    def __post_init__(self) -> None:
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"--vllm_gpu_memory_utilization must be in (0, 1], got {u}")


@dataclass
class PPOCkptSection(CkptSection):
    """Checkpoints (counted in rollout steps) and the final model."""

    disable_ds: bool = flag(
        False,
        "checkpoints hold the HF policy only (needs --save_hf_ckpt), no DeepSpeed states: smaller, but "
        "--load_checkpoint cannot resume from them",
        flat="disable_ds_ckpt",
    )
    best_metric_key: str = flag(
        "",
        "besides the newest --max_ckpt_num, keep the checkpoint whose evaluation (at its step) scored highest on "
        "this metric, e.g. eval/default/pass@1 (empty: eval/accuracy when --eval_dataset is given; none: off)",
        flat="best_metric_key",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.disable_ds and not self.save_hf:
            raise ValueError(
                "--disable_ds_ckpt leaves the DeepSpeed states out of each checkpoint, so without --save_hf_ckpt "
                "a checkpoint would hold no weights at all: add --save_hf_ckpt"
            )


@dataclass
class PPOLoggerSection(LoggerSection):
    """Metrics (metrics.jsonl, TensorBoard, Weights & Biases: docs/tracking.md) and sample logs."""

    metrics_file: str = flag("", "JSON-lines metrics (default: OUTPUT_DIR/metrics.jsonl)", flat="metrics_file")
    log_samples_steps: int = flag(
        0,
        "every N steps, a few generated samples (prompt, response, reward) go to samples.jsonl beside the "
        "metrics file and to a wandb table; evaluation samples too, at each evaluation (0: off)",
        flat="log_samples_steps",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.log_samples_steps < 0:
            raise ValueError(f"--log_samples_steps must be >= 0 (0: off), got {self.log_samples_steps}")


@dataclass
class EvalSection:
    """Held-out evaluation through the same services (never trained on)."""

    dataset: str = flag(
        "",
        "held-out prompts, evaluated through the rollout and reward services (never trained on) at the start, "
        "every --eval_steps and at the end (same forms as --prompt_data; comma-separated: one data source each)",
        flat="eval_dataset",
        aliases=("--eval_data",),
    )
    split: str = flag(
        "train", "split of --eval_dataset (a saved or hub dataset; a data file is its one split)", flat="eval_split"
    )
    datasource_key: str = flag(
        "datasource",
        "--eval_dataset column naming each row's data source: metrics are reported per source (rows without it: "
        "the file's name when --eval_dataset lists several, else 'default')",
        flat="eval_datasource_key",
    )
    steps: int = flag(
        -1,
        "evaluate --eval_dataset every N steps, and at the start and the end (-1: start and end only)",
        flat="eval_steps",
    )
    temperature: float = flag(0.6, "sampling temperature of evaluation (0: greedy)", flat="eval_temperature")
    n_samples_per_prompt: int = flag(
        4, "samples per evaluation prompt (the n of pass@n)", flat="eval_n_samples_per_prompt"
    )
    pass_threshold: float = flag(
        0.5,
        "an evaluation sample passes when its reward is above this (pass@1, pass@n, eval/accuracy)",
        flat="eval_pass_threshold",
    )

    def __post_init__(self) -> None:
        if self.steps == 0 or self.steps < -1:
            raise ValueError(f"--eval_steps must be -1 (start and end only) or > 0, got {self.steps}")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--eval_n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.temperature < 0:
            raise ValueError(f"--eval_temperature must be >= 0 (0: greedy), got {self.temperature}")


@dataclass
class DataSection:
    """The prompts and their limits."""

    prompt_dataset: str = flag(
        "", "prompt dataset: json/jsonl/parquet file, saved dataset dir, or hub name", required=True, flat="prompt_data"
    )
    prompt_probs: str = flag(
        "",
        "sampling probabilities of comma-separated --prompt_data, interleaved with --seed until every source is "
        "used up (datasets.interleave_datasets, as OpenRLHF); empty: the sources one after another",
        flat="prompt_data_probs",
    )
    prompt_split: str = flag(
        "train", "split of --prompt_data (a saved or hub dataset; a data file is its one split)", flat="prompt_split"
    )
    input_key: str = flag("input", "dataset column holding the prompt", flat="input_key")
    label_key: str = flag("", "dataset column holding the label passed to reward functions", flat="label_key")
    input_template: str = flag("", "template with one {} for the prompt, e.g. 'Q: {}\\nA:'", flat="input_template")
    apply_chat_template: bool = flag(
        False, "wrap each prompt with the tokenizer's chat template", flat="apply_chat_template"
    )
    max_samples: int = flag(
        10**8,
        "at most this many prompts: the first N of each --prompt_data source, then of their mix; and of "
        "--eval_dataset's (as OpenRLHF)",
        flat="max_samples",
    )
    skip_bad_rows: bool = flag(
        False,
        "skip rows with a missing key or an over-long prompt (counted) instead of failing with the file, row and key",
        flat="skip_bad_rows",
    )
    prompt_max_len: int = flag(1024, "prompts longer than this (tokens) are an error or skipped", flat="prompt_max_len")
    max_len: int = flag(
        0,
        "a sample's cap, prompt plus response (an agent episode: plus every turn), in tokens (0: --prompt_max_len "
        "+ --generate_max_len)",
        flat="max_len",
    )
    disable_fast_tokenizer: bool = flag(False, "slow tokenizer", inert="rayless loads the tokenizer transformers picks")
    dataloader_num_workers: int = flag(0, "dataloader workers", inert="prompts are read once, on rank 0")
    image_key: str = flag("images", "dataset key of images", inert="vision is issue 42, not built yet")
    max_images_per_prompt: int = flag(0, "images per prompt", inert="vision is issue 42, not built yet")

    def __post_init__(self) -> None:
        if self.max_len < 0:
            raise ValueError(f"--max_len must be >= 0 (0: --prompt_max_len + --generate_max_len), got {self.max_len}")
        if self.max_samples < 1:
            raise ValueError(f"--max_samples must be >= 1, got {self.max_samples}")


@dataclass
class AgentSection:
    """Multi-turn agent episodes in the rollout servers (docs/agents.md); the file: --train.agent_func_path."""

    max_turns: int = flag(0, "actions per episode at most (0: the environment decides)", flat="agent_max_turns")
    step_timeout_s: float = flag(
        60.0,
        "one reset() or step() of the environment; an episode past it fails (see --agent_failure)",
        flat="agent_step_timeout_s",
    )
    env_workers: int = flag(
        0,
        "environment worker processes per rollout server the episodes run in (a hung, crashing, leaking or "
        "exiting step fails its episode, never the server; 0: in the server's process); launch.local passes it on",
        flat="agent_env_workers",
    )
    episode_timeout_s: float = flag(
        0.0,
        "with --agent_env_workers: an episode's wall time at most (0: no limit); launch.local passes it on",
        flat="agent_episode_timeout_s",
    )
    env_worker_memory_mb: float = flag(
        0.0,
        "with --agent_env_workers: resident memory of one worker at most, in MiB (0: no limit); launch.local "
        "passes it on",
        flat="agent_env_worker_memory_mb",
    )
    failure: str = flag(
        "retry",
        "a prompt whose episode failed (the environment raised, hung or answered garbage): retry (issue it "
        "again, up to 5 times, then stop the run naming it) or drop (leave its group out, counted)",
        choices=("retry", "drop"),
        flat="agent_failure",
    )
    tool_call_parser: str = flag(
        "",
        "an OpenAI-API agent file's (agent_func): the vLLM tool parser the rollout servers parse its replies' "
        "tool calls with (vLLM's --tool-call-parser names: hermes, llama3_json, ...); launch.local passes it on",
        flat="tool_call_parser",
    )

    def __post_init__(self) -> None:
        if self.max_turns < 0:
            raise ValueError(f"--agent_max_turns must be >= 0 (0: the environment decides), got {self.max_turns}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"--agent_step_timeout_s must be > 0, got {self.step_timeout_s}")


@dataclass
class ServicesSection:
    """The processes and the wire (rayless's own)."""

    controller_bind: str = flag(
        "tcp://127.0.0.1:5555",
        "where the controller (rank 0) listens for services: loopback by default; a wider bind "
        "(tcp://0.0.0.0:5555) only when asked, and with --auth_dir (a warning without it)",
        flat="controller_bind",
    )
    min_rollout_servers: int = flag(
        1, "wait for this many rollout servers before the first step", flat="min_rollout_servers"
    )
    min_reward_services: int = flag(
        1, "wait for this many reward services before the first step", flat="min_reward_services"
    )
    wait_for_services_s: float = flag(600.0, "give up waiting for services after this long", flat="wait_for_services_s")
    keep_services: bool = flag(
        False,
        "when training finishes, leave the services running instead of telling them to exit: they wait "
        "--reconnect_timeout_s for the next learner at the same --controller_bind (a long-lived fleet that "
        "successive runs join; the next learner pushes them its own weights before any prompt)",
        flat="keep_services",
    )
    peer_timeout_s: float = flag(
        30.0, "a service silent this long is declared dead; its work is re-issued", flat="peer_timeout_s"
    )
    auth_dir: str = flag(
        "",
        "folder of the run's CURVE keys (python -m common.auth keygen DIR): encrypted, and only peers holding "
        "them are admitted; empty: no authentication",
        flat="auth_dir",
    )
    generate_timeout_s: float = flag(
        600.0, "re-issue a prompt not generated within this long", flat="generate_timeout_s"
    )
    score_timeout_s: float = flag(300.0, "re-score a prompt not scored within this long", flat="score_timeout_s")
    weight_sync_timeout_s: float = flag(
        300.0, "deadline of one weight push to one server", flat="weight_sync_timeout_s"
    )
    lora_sync: str = flag(
        "merged",
        "with --lora_rank: what a push sends. merged: W + (alpha/r)*B*A per layer, computed out of place in "
        "fp32 and sent under the base model's names (the servers need nothing of their own). adapter: the "
        "adapter alone (the base weights once per server), which vLLM serves; the rollout servers need "
        "--enable_lora --max_lora_rank >= --lora_rank (docs/rollout.md)",
        choices=("merged", "adapter"),
        flat="lora_sync",
    )
    weight_sync: str = flag(
        "full",
        "what a weight push sends. full: every tensor. delta: per tensor only the values changed in the served "
        "dtype since the last push (indices and values, or the tensor whole when denser), checked by a digest "
        "per tensor on every server; a server without the last push gets a full one first. The learner keeps a "
        "host copy of the served weights (docs/scale.md, Delta pushes)",
        choices=("full", "delta"),
        flat="weight_sync",
    )
    sync_host: str = flag(
        "",
        "address rollout servers reach this rank at for weight sync; its stores listen there when it is an IP "
        "(default: --controller_bind's address when it names one, else the hostname; docs/security.md)",
        flat="sync_host",
    )
