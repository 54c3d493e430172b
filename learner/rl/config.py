"""Flags of ``learner.train_ppo``.

Names follow OpenRLHF's ``train_ppo_ray`` wherever the meaning is the same, so a user's script
ports by swapping the module. Ray placement flags are accepted and explained: here, placement
is which processes you start and where (see README's multi-terminal recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config import flag
from common.weights import known_backends
from learner.runtime.checkpoint_config import CheckpointFlags
from learner.runtime.flags import OptimizerFlags
from learner.runtime.tracking import WandbFlags

# OpenRLHF passes these to the vLLM engines it creates; here each rollout_service is started
# with its own engine flags (launch.local and the Slurm scripts pass them on).
ENGINE_FLAGS = {"enforce_eager": "--enforce_eager", "vllm_tensor_parallel_size": "--tensor_parallel_size"}

RAY_PLACEMENT_FLAGS = (
    "ref_num_nodes",
    "ref_num_gpus_per_node",
    "actor_num_nodes",
    "actor_num_gpus_per_node",
    "critic_num_nodes",
    "critic_num_gpus_per_node",
    "reward_num_nodes",
    "reward_num_gpus_per_node",
    "vllm_num_engines",
    "colocate_actor_ref",
    "colocate_critic_reward",
)


@dataclass
class ModelFlags:
    """The models: the policy, and those the reward services serve for it; where the result goes."""

    pretrain: str = flag("", "policy model: HF hub name or local path", required=True, group="model")
    reward_pretrain: str = flag(
        "",
        "reward model: served by reward_service (launch.local passes it on); the "
        "learner checks a connected reward service scores with a reward model",
        group="model",
    )
    remote_rm_url: str = flag(
        "",
        "reward function file (reward_func.py) or HTTP reward URL(s), comma-separated: served by reward_service "
        "--remote_rm_url (launch.local passes it on)",
        group="model",
    )
    critic_pretrain: str = flag(
        "",
        "critic (--advantage_estimator gae): default --reward_pretrain if set, else "
        "--pretrain; a causal LM gets a fresh value head",
        group="model",
    )
    ref_pretrain: str = flag(
        "",
        "reference model for KL: served by reward_service --ref_pretrain (launch.local "
        "passes it on, default --pretrain when KL is on)",
        group="model",
    )
    save_path: str = flag("./ckpt/ppo", "where the final HF-format policy is written", group="model")
    save_value_network: bool = flag(
        False, "also write the trained critic (gae) in HF format to SAVE_PATH_critic", group="model"
    )


@dataclass
class DataFlags:
    """The prompts and their limits."""

    prompt_data: str = flag(
        "", "prompt dataset: json/jsonl/parquet file, saved dataset dir, or hub name", required=True, group="data"
    )
    prompt_data_probs: str = flag("", "mixing probabilities for comma-separated --prompt_data", group="data")
    prompt_split: str = flag("train", "dataset split", group="data")
    eval_dataset: str = flag(
        "",
        "held-out prompts, evaluated through the rollout and reward services (never trained on) at the start, "
        "every --eval_steps and at the end (same forms as --prompt_data; comma-separated: one data source each)",
        aliases=("--eval_data",),
        group="eval",
    )
    eval_split: str = flag("train", "split of --eval_dataset", group="eval")
    eval_datasource_key: str = flag(
        "datasource",
        "--eval_dataset column naming each row's data source: metrics are reported per source (rows without it: "
        "the file's name when --eval_dataset lists several, else 'default')",
        group="eval",
    )
    input_key: str = flag("input", "dataset column holding the prompt", group="data")
    label_key: str = flag("", "dataset column holding the label passed to reward functions", group="data")
    input_template: str = flag("", "template with one {} for the prompt, e.g. 'Q: {}\\nA:'", group="data")
    apply_chat_template: bool = flag(False, "wrap each prompt with the tokenizer's chat template", group="data")
    max_samples: int = flag(10**9, "use at most this many prompts", group="data")
    skip_bad_rows: bool = flag(
        False,
        "skip rows with a missing key or an over-long prompt (counted) instead of failing with the file, row and key",
        group="data",
    )
    prompt_max_len: int = flag(1024, "prompts longer than this (tokens) are an error or skipped", group="data")
    generate_max_len: int = flag(1024, "max new tokens per sample", group="data")


@dataclass
class BatchFlags:
    """Batch sizes (OpenRLHF's semantics: ``rollout_batch_size`` prompts per step, each sampled
    ``n_samples_per_prompt`` times; ``train_batch_size`` samples per optimizer step) and run length."""

    rollout_batch_size: int = flag(512, "prompts per rollout step", group="batch")
    n_samples_per_prompt: int = flag(1, "samples per prompt (the group size G)", group="batch")
    micro_rollout_batch_size: int = flag(8, "samples per forward pass when computing log-probs", group="batch")
    train_batch_size: int = flag(128, "samples per optimizer step (global)", group="batch")
    micro_train_batch_size: int = flag(8, "samples per forward/backward pass per rank", group="batch")
    max_epochs: int = flag(1, "passes over each rollout batch", group="batch")
    recompute_old_logprobs: bool = flag(
        False,
        "always run the no-grad old-log-probs forward; by default an on-policy rollout trained by one optimizer "
        "step in one epoch takes them from the training forward (the same values)",
        group="batch",
    )
    packing_samples: bool = flag(
        False,
        "pack each micro-batch's samples into one row (no padding; position ids restart per sample, attention "
        "stays within each sample) for the log-prob, critic and training forwards",
        group="batch",
    )
    num_episodes: int = flag(1, "passes over the prompt dataset", group="batch")
    max_steps: int = flag(0, "stop after this many rollout steps (0: no limit)", group="batch")


@dataclass
class RLOptimizerFlags(OptimizerFlags):
    """The shared optimizer section plus the RL learning rates (policy and critic)."""

    actor_learning_rate: float = flag(1e-6, "policy learning rate", group="optim")
    critic_learning_rate: float = flag(9e-6, "critic learning rate (--advantage_estimator gae)", group="optim")


@dataclass
class AlgorithmFlags:
    """Estimator, losses, KL, reward shaping, the importance correction, dynamic filtering."""

    advantage_estimator: str = flag(
        "gae",
        "advantage estimator (gae: PPO with a critic, as OpenRLHF; group_norm: GRPO)",
        choices=("gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"),
        group="algorithm",
    )
    no_advantage_std_norm: bool = flag(False, "group_norm without dividing by the group std", group="algorithm")
    policy_loss_type: str = flag(
        "ppo", "ppo (token ratio) or gspo (sequence ratio)", choices=("ppo", "gspo"), group="algorithm"
    )
    loss_agg_mode: str = flag(
        "token_mean",
        "how per-token losses are averaged",
        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"),
        group="algorithm",
    )
    eps_clip: float = flag(0.2, "PPO clip range", group="algorithm")
    eps_clip_low_high: list[float] = flag(
        [], "asymmetric clip (low high), e.g. 0.2 0.28 (clip-higher)", group="algorithm"
    )
    dual_clip: float = flag(0.0, "dual-clip constant c > 1 (0: off)", group="algorithm")
    init_kl_coef: float = flag(
        0.01, "KL coefficient (in the reward, or of the loss with --use_kl_loss)", group="algorithm"
    )
    kl_target: float = flag(0.0, "adaptive KL controller target (0: fixed coefficient)", group="algorithm")
    kl_horizon: int = flag(10000, "adaptive KL controller horizon", group="algorithm")
    use_kl_loss: bool = flag(False, "KL as a loss term instead of in the reward", group="algorithm")
    kl_estimator: str = flag("k1", "KL estimator", choices=("k1", "k2", "k3"), group="algorithm")
    entropy_loss_coef: float = flag(
        0.0, "entropy bonus coefficient (with 0, entropy is still logged every --logging_steps)", group="algorithm"
    )
    value_clip: float = flag(0.5, "critic value clipping around the old values (<= 0: off; gae)", group="algorithm")
    freezing_actor_steps: int = flag(
        0, "critic-only warm-up: the policy is not updated for this many rollout steps (gae)", group="algorithm"
    )
    gamma: float = flag(1.0, "discount", group="algorithm")
    lambd: float = flag(1.0, "GAE lambda", group="algorithm")
    normalize_reward: bool = flag(
        False,
        "reward service normalises RM scores with the RM's saved mean/std (launch.local passes it on)",
        group="algorithm",
    )
    reward_clip_range: list[float] = flag([-10.0, 10.0], "clip rewards to [low, high]", group="algorithm")
    overlong_buffer_len: int = flag(0, "DAPO overlong penalty window (tokens before the max length)", group="algorithm")
    overlong_penalty_factor: float = flag(1.0, "DAPO overlong penalty at the max length", group="algorithm")
    stop_properly_penalty_coef: float = flag(
        -1.0, "reward of samples cut at the max length (<0: off)", group="algorithm"
    )
    is_correction: str = flag(
        "auto",
        "importance correction against the sampler's log-probs (vLLM mismatch; with --async_train also the "
        "policy lag): tis | icepop | seq_mask_tis | none (off) | auto (tis with --async_train, else off)",
        choices=("auto", "none", "", "tis", "icepop", "seq_mask_tis"),
        group="algorithm",
    )
    is_correction_low_high: list[float] = flag(
        [0.0, 2.0],
        "IS ratio thresholds (low high): tis truncates at high; icepop keeps ratios in [low, high]; "
        "seq_mask_tis zeroes a sequence whose geometric-mean ratio leaves [low, high]",
        group="algorithm",
    )
    dynamic_filtering: bool = flag(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and collect more prompts to refill the batch",
        group="algorithm",
    )
    dynamic_filtering_reward_range: list[float] = flag(
        [], "also drop groups whose mean reward is outside the open interval (low high), e.g. 0 1", group="algorithm"
    )
    dynamic_filtering_max_collects: int = flag(
        4,
        "extra collects per step to refill a filtered batch; then train on what was kept (a warning)",
        group="algorithm",
    )


@dataclass
class SamplingFlags:
    """How the rollout servers sample."""

    temperature: float = flag(1.0, "sampling temperature", group="rollout")
    top_p: float = flag(1.0, "nucleus sampling", group="rollout")
    top_k: int = flag(-1, "top-k sampling (-1: off)", group="rollout")
    seed_sampling: bool = flag(
        False,
        "sample each prompt with its own seed, from --seed and the prompt's place in the run (its stream "
        "position; a dynamic-filtering refill: its step and draw), on whichever server and retry: a run samples "
        "what a run with the same flags sampled, and a run resumed from a checkpoint what the uninterrupted run "
        "did (vLLM keeps a generator per seeded request: a little slower sampling on GPUs)",
        group="rollout",
    )


@dataclass
class ScheduleFlags:
    """Which schedule runs (``learner/rl/schedules``): async (docs/async.md), colocated (docs/colocated.md)."""

    async_train: bool = flag(
        False,
        "async (off-policy) schedule: rollout servers keep generating while the learner trains; "
        "weights are pushed after every step without stopping generation",
        group="async",
    )
    max_staleness: int = flag(
        1,
        "--async_train: every trained sample was started by weights at most this many versions behind "
        "the ones being trained (0: lockstep's samples, on-policy)",
        group="async",
    )
    colocate_all_models: bool = flag(
        False,
        "colocated lockstep schedule: learner ranks and rollout engines share the same GPUs and take turns "
        "(start them on the same devices: launch.local and launch/grpo_colocated.slurm do)",
        group="colocate",
    )
    vllm_enable_sleep: bool = flag(
        False,
        "--colocate_all_models: rollout engines sleep (vLLM sleep mode) while the learner trains and wake to "
        "generate; the servers need --enable_sleep (launch.local passes it on); GPU only",
        group="colocate",
    )
    deepspeed_enable_sleep: bool = flag(
        False,
        "--colocate_all_models: DeepSpeed offloads optimizer states and gradients to host memory while the "
        "engines generate (offload_states / reload_states); GPU with a ZeRO optimizer only",
        group="colocate",
    )
    vllm_gpu_memory_utilization: float | None = flag(
        None,
        "share of each GPU the rollout engines should take (launch.local passes it to rollout_service "
        "--gpu_memory_utilization; the learner checks what the servers announce); unset: the servers' own",
        group="colocate",
    )


@dataclass
class AgentFlags:
    """Multi-turn agent episodes in the rollout servers (docs/agents.md; OpenRLHF's names)."""

    agent_func_path: str = flag(
        "",
        "an agent file (OpenRLHF's AgentExecutor contract): every prompt runs as a multi-turn episode on the "
        "rollout servers, which load the same file (launch.local passes it on); the agent's rewards are the reward",
        group="agents",
    )
    max_len: int = flag(
        0,
        "an episode's cap: prompt plus every turn, in tokens (0: --prompt_max_len + --generate_max_len)",
        group="agents",
    )
    agent_max_turns: int = flag(0, "actions per episode at most (0: the environment decides)", group="agents")
    agent_step_timeout_s: float = flag(
        60.0, "one reset() or step() of the environment; an episode past it fails (see --agent_failure)", group="agents"
    )
    agent_failure: str = flag(
        "retry",
        "a prompt whose episode failed (the environment raised, hung or answered garbage): retry (issue it "
        "again, up to 5 times, then stop the run naming it) or drop (leave its group out, counted)",
        choices=("retry", "drop"),
        group="agents",
    )

    def check_agent(self) -> None:
        if self.max_len < 0:
            raise ValueError(f"--max_len must be >= 0 (0: --prompt_max_len + --generate_max_len), got {self.max_len}")
        if not self.max_len:
            self.max_len = self.prompt_max_len + self.generate_max_len
        if not self.agent_func_path:
            return
        if not self.agent_func_path.endswith(".py"):
            raise ValueError(f"--agent_func_path {self.agent_func_path}: an agent is a Python file (.py)")
        if self.agent_max_turns < 0:
            raise ValueError(f"--agent_max_turns must be >= 0 (0: the environment decides), got {self.agent_max_turns}")
        if not self.agent_step_timeout_s > 0:
            raise ValueError(f"--agent_step_timeout_s must be > 0, got {self.agent_step_timeout_s}")
        if self.reward_pretrain:
            raise ValueError(
                "--agent_func_path with --reward_pretrain: the agent's rewards are the reward; adding a reward "
                "model's on top is not built (docs/agents.md)"
            )
        self.agent_params()  # the file is read now: a missing one fails here, naming the flag
        if not self.kl_needed and self.min_reward_services:
            self.min_reward_services = 0
            self.notices.append(
                "--agent_func_path without KL: the agent scores its episodes, no reward service is waited for"
            )

    def agent_params(self) -> Any:
        """The ``AgentParams`` every prompt batch carries, or None without an agent."""
        if not self.agent_func_path:
            return None
        from common.agent_file import agent_identity
        from common.protocol import AgentParams

        return AgentParams(
            agent=agent_identity(self.agent_func_path),
            max_len=self.max_len,
            max_turns=self.agent_max_turns,
            step_timeout_s=self.agent_step_timeout_s,
        )


@dataclass
class ServiceFlags:
    """The processes and the wire (rayless's own)."""

    controller_bind: str = flag(
        "tcp://0.0.0.0:5555", "where the controller (rank 0) listens for services", group="services"
    )
    min_rollout_servers: int = flag(1, "wait for this many rollout servers before the first step", group="services")
    min_reward_services: int = flag(1, "wait for this many reward services before the first step", group="services")
    wait_for_services_s: float = flag(600.0, "give up waiting for services after this long", group="services")
    keep_services: bool = flag(
        False,
        "when training finishes, leave the services running instead of telling them to exit: they wait "
        "--reconnect_timeout_s for the next learner at the same --controller_bind (a long-lived fleet that "
        "successive runs join; the next learner pushes them its own weights before any prompt)",
        group="services",
    )
    peer_timeout_s: float = flag(
        30.0, "a service silent this long is declared dead; its work is re-issued", group="services"
    )
    auth_dir: str = flag(
        "",
        "folder of the run's CURVE keys (python -m common.auth keygen DIR): encrypted, and only peers holding them are admitted; empty: no authentication",
        group="services",
    )
    generate_timeout_s: float = flag(600.0, "re-issue a prompt not generated within this long", group="services")
    score_timeout_s: float = flag(300.0, "re-score a prompt not scored within this long", group="services")
    weight_sync_timeout_s: float = flag(300.0, "deadline of one weight push to one server", group="services")
    weight_sync_backend: str = flag(
        "auto",
        "auto (nccl on GPUs, gloo on CPUs) | nccl | gloo",
        choices=tuple(known_backends()),
        aliases=("--vllm_sync_backend",),
        group="services",
    )
    lora_sync: str = flag(
        "merged",
        "with --lora_rank: what a push sends. merged: W + (alpha/r)*B*A per layer, computed out of place in "
        "fp32 and sent under the base model's names (the servers need nothing of their own). adapter: the "
        "adapter alone (the base weights once per server), which vLLM serves; the rollout servers need "
        "--enable_lora --max_lora_rank >= --lora_rank (docs/rollout.md)",
        choices=("merged", "adapter"),
        group="services",
    )
    sync_host: str = flag(
        "",
        "address rollout servers reach this rank at for weight sync; its stores listen there when it is an IP "
        "(default: --controller_bind's address when it names one, else the hostname; docs/security.md)",
        group="services",
    )


@dataclass
class LoggingFlags(CheckpointFlags, WandbFlags):
    """Metrics (metrics.jsonl, TensorBoard, Weights & Biases: docs/tracking.md), evaluation, and
    checkpoints (the flags every trainer shares: ``CheckpointFlags``, ``WandbFlags``)."""

    logging_steps: int = flag(1, "log every N steps", group="logging")
    log_samples_steps: int = flag(
        0,
        "every N steps, a few generated samples (prompt, response, reward) go to samples.jsonl beside the "
        "metrics file and to a wandb table; evaluation samples too, at each evaluation (0: off)",
        group="logging",
    )
    eval_steps: int = flag(
        -1, "evaluate --eval_dataset every N steps, and at the start and the end (-1: start and end only)", group="eval"
    )
    eval_temperature: float = flag(0.6, "sampling temperature of evaluation (0: greedy)", group="eval")
    eval_n_samples_per_prompt: int = flag(4, "samples per evaluation prompt (the n of pass@n)", group="eval")
    eval_pass_threshold: float = flag(
        0.5, "an evaluation sample passes when its reward is above this (pass@1, pass@n, eval/accuracy)", group="eval"
    )
    # RL counts checkpoints in rollout steps (the supervised trainers in optimizer steps)
    save_steps: int = flag(
        -1,
        "save a checkpoint (engines, optimizer, LR schedule, run state, RNG; docs/checkpoints.md) every N "
        "rollout steps (<= 0: never; the final HF policy is written to SAVE_PATH regardless)",
        group="ckpt",
    )
    disable_ds_ckpt: bool = flag(
        False,
        "checkpoints hold the HF policy only (needs --save_hf_ckpt), no DeepSpeed states: smaller, but "
        "--load_checkpoint cannot resume from them",
        group="ckpt",
    )
    best_metric_key: str = flag(
        "",
        "besides the newest --max_ckpt_num, keep the checkpoint whose evaluation (at its step) scored highest on "
        "this metric, e.g. eval/default/pass@1 (empty: eval/accuracy when --eval_dataset is given; none: off)",
        group="ckpt",
    )
    use_tensorboard: str = flag("", "TensorBoard log dir (default: SAVE_PATH/tensorboard)", group="logging")
    metrics_file: str = flag("", "JSON-lines metrics (default: SAVE_PATH/metrics.jsonl)", group="logging")


@dataclass
class OpenRLHFCompatFlags:
    """Accepted so OpenRLHF scripts run unchanged, and explained: Ray placement (here, placement is
    which processes you start) and vLLM engine flags (rollout_service's own, passed on by launch.local)."""

    enforce_eager: bool = flag(
        False, "vLLM engine flag: pass --enforce_eager to rollout_service (launch.local passes it on)", group="colocate"
    )
    ref_num_nodes: int = flag(0, "Ray placement (ignored: start reward_service processes yourself)", group="ray")
    ref_num_gpus_per_node: int = flag(0, "Ray placement (ignored)", group="ray")
    actor_num_nodes: int = flag(0, "Ray placement (ignored: torchrun --nnodes decides)", group="ray")
    actor_num_gpus_per_node: int = flag(0, "Ray placement (ignored: torchrun --nproc_per_node decides)", group="ray")
    critic_num_nodes: int = flag(0, "Ray placement (ignored)", group="ray")
    critic_num_gpus_per_node: int = flag(0, "Ray placement (ignored)", group="ray")
    reward_num_nodes: int = flag(0, "Ray placement (ignored)", group="ray")
    reward_num_gpus_per_node: int = flag(0, "Ray placement (ignored)", group="ray")
    vllm_num_engines: int = flag(0, "Ray placement (ignored: start that many rollout_service processes)", group="ray")
    vllm_tensor_parallel_size: int = flag(0, "pass --tensor_parallel_size to rollout_service instead", group="ray")
    colocate_actor_ref: bool = flag(False, "Ray placement (ignored)", group="ray")
    colocate_critic_reward: bool = flag(False, "Ray placement (ignored)", group="ray")


@dataclass
class PPOConfig(
    OpenRLHFCompatFlags,
    LoggingFlags,
    AgentFlags,
    ServiceFlags,
    ScheduleFlags,
    SamplingFlags,
    AlgorithmFlags,
    RLOptimizerFlags,
    BatchFlags,
    DataFlags,
    ModelFlags,
):
    """Every flag of ``learner.train_ppo``: the union of its sections, each a type of its own (code
    that needs one section can take that type; the supervised trainers share ``OptimizerFlags``).
    The sections are listed last to first so that ``--help`` shows them from the models down.

    Checks that rewrite a flag (a default switched to fit another flag, a flag that cannot act)
    do not log while the flags parse, before logging is set up and on every rank: they are kept
    in ``notices``, which the run logs once, on rank 0 (``learner.rl.run.init_process``)."""

    def __post_init__(self) -> None:
        super().__post_init__()  # CheckpointFlags'
        self.notices: list[str] = []  # not a flag: what the checks below changed or found inert
        self.check_optimizer()
        self.check_lora()  # OptimizerFlags', shared with the supervised trainers
        if not self.lora_rank and self.lora_sync != "merged":
            self.notices.append(f"--lora_sync {self.lora_sync} has no effect without --lora_rank")
        self.check_agent()
        g = self.n_samples_per_prompt
        if g < 1:
            raise ValueError(f"--n_samples_per_prompt must be >= 1, got {g}")
        if self.advantage_estimator in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline") and g < 2:
            raise ValueError(
                f"--advantage_estimator {self.advantage_estimator} compares samples of one prompt: "
                f"needs --n_samples_per_prompt >= 2, got {g}"
            )
        samples = self.rollout_batch_size * g
        if samples % self.train_batch_size:
            raise ValueError(
                f"rollout_batch_size x n_samples_per_prompt = {samples} samples per step must be a "
                f"multiple of --train_batch_size {self.train_batch_size}"
            )
        if self.train_batch_size % self.micro_train_batch_size:
            raise ValueError(
                f"--train_batch_size {self.train_batch_size} must be a multiple of "
                f"--micro_train_batch_size {self.micro_train_batch_size}"
            )
        self.check_wandb()
        self._check_logging()
        self._check_async()
        self._check_colocate()
        self._check_algorithm()
        if self.normalize_reward and not self.reward_pretrain:
            # OpenRLHF scripts carry it with rule rewards too; it only concerns a reward model.
            self.notices.append(
                "--normalize_reward normalises a reward model's scores; without --reward_pretrain it does nothing"
            )

    def _check_logging(self) -> None:
        """Evaluation, sample logging and the checkpoint flags that go with them."""
        if self.eval_steps == 0 or self.eval_steps < -1:
            raise ValueError(f"--eval_steps must be -1 (start and end only) or > 0, got {self.eval_steps}")
        if self.eval_n_samples_per_prompt < 1:
            raise ValueError(f"--eval_n_samples_per_prompt must be >= 1, got {self.eval_n_samples_per_prompt}")
        if self.eval_temperature < 0:
            raise ValueError(f"--eval_temperature must be >= 0 (0: greedy), got {self.eval_temperature}")
        if self.eval_temperature == 0 and self.eval_n_samples_per_prompt > 1:
            self.notices.append(
                f"--eval_temperature 0 is greedy: the {self.eval_n_samples_per_prompt} samples of each evaluation "
                "prompt are the same answer, so pass@n equals pass@1 (--eval_n_samples_per_prompt 1 costs less)"
            )
        if self.log_samples_steps < 0:
            raise ValueError(f"--log_samples_steps must be >= 0 (0: off), got {self.log_samples_steps}")
        if self.disable_ds_ckpt and not self.save_hf_ckpt:
            raise ValueError(
                "--disable_ds_ckpt leaves the DeepSpeed states out of each checkpoint, so without --save_hf_ckpt "
                "a checkpoint would hold no weights at all: add --save_hf_ckpt"
            )
        explicit_best = self.best_metric_key not in ("", "none")
        if explicit_best and not self.eval_dataset:
            raise ValueError(
                f"--best_metric_key {self.best_metric_key} ranks checkpoints by an evaluation: it needs --eval_dataset"
            )
        if explicit_best and self.save_steps and (self.eval_steps < 0 or self.eval_steps % self.save_steps):
            # A checkpoint is ranked by the evaluation of its own weights, at its own step.
            self.notices.append(
                f"--best_metric_key ranks a checkpoint by the evaluation at its step, but with --eval_steps "
                f"{self.eval_steps} and --save_steps {self.save_steps} some evaluations have no checkpoint to keep: "
                "make --eval_steps a multiple of --save_steps"
            )

    def _check_async(self) -> None:
        """--async_train's flags, and the IS correction it defaults (``auto`` resolves here)."""
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if not self.async_train:
            if self.max_staleness != 1:
                raise ValueError("--max_staleness bounds the async schedule's lag: it needs --async_train")
            self.is_correction = "" if self.is_correction in ("auto", "none") else self.is_correction
            return
        if self.is_correction == "":
            # Samples are up to K versions old: without a correction the update is biased by the lag.
            raise ValueError(
                "--async_train trains on samples from older weights and needs --is_correction "
                "(default tis); pass --is_correction none to train without one"
            )
        if self.is_correction == "none":
            self.notices.append("--async_train with --is_correction none: no importance correction for the policy lag")
            self.is_correction = ""
        elif self.is_correction == "auto":
            self.is_correction = "tis"

    def _check_colocate(self) -> None:
        """--colocate_all_models and its sleep flags (OpenRLHF's meanings, docs/colocated.md)."""
        u = self.vllm_gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"--vllm_gpu_memory_utilization must be in (0, 1], got {u}")
        if self.colocate_all_models and self.async_train:
            # Colocated engines sleep while the learner trains; async keeps them generating then.
            raise ValueError(
                "--colocate_all_models and --async_train contradict each other: colocated engines and learner "
                "take turns on the same GPUs, async generates while training; drop one of them"
            )
        if self.async_train and self.vllm_enable_sleep:
            raise ValueError("--vllm_enable_sleep makes the engines sleep while training: not with --async_train")
        for name in ("vllm_enable_sleep", "deepspeed_enable_sleep"):
            if getattr(self, name) and not self.colocate_all_models:
                # As OpenRLHF: without colocation nothing else wants the memory, so the flag is off.
                self.notices.append(f"--{name} acts only with --colocate_all_models: turned off")
                setattr(self, name, False)

    def _check_algorithm(self) -> None:
        """Flag combinations that would fail deep inside a step, refused at parse time."""
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
        if self.policy_loss_type == "gspo" and self.loss_agg_mode != "seq_mean_token_mean":
            # GSPO's ratio is per sequence, so its loss is a mean over sequences. The default
            # token_mean is switched (the user did not ask for anything else); an explicit
            # other sequence mode is a contradiction and refused.
            if self.loss_agg_mode != "token_mean":
                raise ValueError(
                    f"--policy_loss_type gspo needs --loss_agg_mode seq_mean_token_mean, got {self.loss_agg_mode}"
                )
            self.notices.append(
                "--policy_loss_type gspo: using --loss_agg_mode seq_mean_token_mean (GSPO's loss is a "
                "mean over sequences)"
            )
            self.loss_agg_mode = "seq_mean_token_mean"
        if self.is_correction:
            if len(self.is_correction_low_high) != 2:
                raise ValueError(
                    f"--is_correction_low_high takes two numbers (low high), got {self.is_correction_low_high}"
                )
            low, high = self.is_correction_low_high
            if not (0 <= low < 1 < high):
                raise ValueError(
                    f"--is_correction {self.is_correction}: thresholds must satisfy "
                    f"0 <= low < 1 < high (a ratio of 1 must pass), got {low} {high}"
                )
        if self.reward_clip_range and (
            len(self.reward_clip_range) != 2 or self.reward_clip_range[0] >= self.reward_clip_range[1]
        ):
            raise ValueError(f"--reward_clip_range takes two numbers low < high, got {self.reward_clip_range}")
        if self.dynamic_filtering:
            if self.n_samples_per_prompt < 2:
                raise ValueError(
                    "--dynamic_filtering drops groups whose rewards are all equal: needs "
                    f"--n_samples_per_prompt >= 2, got {self.n_samples_per_prompt}"
                )
            r = self.dynamic_filtering_reward_range
            if r and (len(r) != 2 or r[0] >= r[1]):
                raise ValueError(f"--dynamic_filtering_reward_range takes two numbers low < high, got {r}")
        if self.advantage_estimator == "gae":
            if self.gamma <= 0 or self.gamma > 1 or self.lambd < 0 or self.lambd > 1:
                raise ValueError(f"--gamma must be in (0, 1] and --lambd in [0, 1], got {self.gamma} {self.lambd}")
            if self.critic_learning_rate <= 0:
                raise ValueError(f"--critic_learning_rate must be > 0, got {self.critic_learning_rate}")
        elif self.freezing_actor_steps:
            raise ValueError("--freezing_actor_steps warms up a critic: only with --advantage_estimator gae")
        elif self.save_value_network:
            raise ValueError(
                f"--save_value_network saves the critic, and --advantage_estimator "
                f"{self.advantage_estimator} has none: only with --advantage_estimator gae"
            )
        elif self.gamma != 1.0 and self.advantage_estimator != "reinforce":
            raise ValueError(
                f"--advantage_estimator {self.advantage_estimator} uses a group baseline: "
                f"--gamma must be 1, got {self.gamma}"
            )

    @property
    def critic_path(self) -> str:
        return self.critic_pretrain or self.reward_pretrain or self.pretrain

    def check_world_size(self, world: int) -> None:
        """Run-time checks that need the number of learner ranks (called by learner.rl.run)."""
        if self.train_batch_size % (self.micro_train_batch_size * world):
            raise ValueError(
                f"--train_batch_size {self.train_batch_size} must be a multiple of "
                f"--micro_train_batch_size {self.micro_train_batch_size} x {world} learner ranks"
            )
        if self.rollout_batch_size % world:
            raise ValueError(
                f"--rollout_batch_size {self.rollout_batch_size} must be divisible by the {world} learner ranks"
            )

    @property
    def kl_needed(self) -> bool:
        return self.use_kl_loss or self.init_kl_coef > 0

    @property
    def clip_low_high(self) -> tuple[float, float]:
        if self.eps_clip_low_high:
            return float(self.eps_clip_low_high[0]), float(self.eps_clip_low_high[1])
        return self.eps_clip, self.eps_clip

    def ray_flags_used(self) -> list[str]:
        return [name for name in RAY_PLACEMENT_FLAGS if getattr(self, name)]

    def engine_flags_used(self) -> list[tuple[str, str]]:
        """(learner flag, rollout_service flag) of vLLM engine flags given to the learner."""
        return [(name, ENGINE_FLAGS[name]) for name in ENGINE_FLAGS if getattr(self, name)]
