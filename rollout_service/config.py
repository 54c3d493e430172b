"""Flags of ``python -m rollout_service``: one dataclass field per flag, one line of help each.

Imports nothing heavy: ``--help`` must answer before torch or vLLM load.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import flag
from common.weights import known_backends


@dataclass
class RolloutConfig:
    # -- engine
    model: str = flag("", "HF model directory or hub name to serve", required=True, group="engine")
    tensor_parallel_size: int = flag(1, "vLLM tensor-parallel size (workers inside this server)", group="engine")
    gpu_memory_utilization: float | None = flag(
        None,
        "share of the accelerator's memory vLLM may use. Default: 0.85 on a GPU; on CPU, where it is a share "
        "of the NUMA node's memory that vLLM wants free at start-up (unless VLLM_CPU_KVCACHE_SPACE sets the "
        "KV cache), what the engine needs: weights + KV cache (VLLM_CPU_KVCACHE_SPACE, else 1 GiB) + 1 GiB "
        "(docs/rollout.md)",
        group="engine",
    )
    max_model_len: int = flag(4096, "longest prompt + response in tokens", group="engine")
    max_num_seqs: int = flag(
        64, "sequences vLLM batches at once; also the capacity announced to the controller", group="engine"
    )
    dtype: str = flag(
        "auto",
        "engine dtype (auto, bfloat16, float16, float32); weights are sent in it",
        choices=("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"),
        group="engine",
    )
    seed: int = flag(0, "engine seed (requests without a seed draw from it)", group="engine")
    enforce_eager: bool = flag(False, "skip CUDA graphs / torch.compile (faster start, slower decode)", group="engine")
    enable_prefix_caching: bool = flag(
        True, "reuse KV of shared prompt prefixes (reset after each weight update)", group="engine"
    )
    enable_chunked_prefill: bool | None = flag(
        None,
        "split long prompts across engine steps; default: off on CPU "
        "(vLLM 0.32 on CPU crashes when a request with a seed is "
        "chunked), vLLM's default on GPU",
        group="engine",
    )
    enable_sleep: bool = flag(
        False,
        "enable vLLM sleep mode so the server can free memory on request (GPU only; on CPU the server "
        "serves without it and answers Sleep/WakeUp not_supported)",
        group="engine",
    )
    idle_spin_s: float | None = flag(
        None,
        "seconds a vLLM worker keeps spinning on its queue after its last step before it sleeps (vLLM 0.32: "
        "1 s, a core taken from whatever runs next on a shared host). Default: the environment's "
        "RAYLESS_VLLM_IDLE_SPIN_S (launch.local --cpu_cores phases sets 0.05), else vLLM's own. A sleeping "
        "worker can miss a wake-up and then waits up to 5 s (vLLM's lost-notify recheck): seen in async runs "
        "with 0.05, so keep short spins for lockstep on shared cores (docs/performance.md)",
        group="engine",
    )
    engine_start_attempts: int = flag(
        3,
        "start the vLLM engine up to this many times (vLLM 0.32 can fail to start on an overloaded host; "
        "a refusal for memory is not retried)",
        group="engine",
    )
    # -- agents
    agent_func_path: str = flag(
        "",
        "an OpenRLHF-style agent file (AgentExecutor; docs/agents.md): prompts the learner sends as agent "
        "episodes run through it here, every turn on this engine; plain prompts are served as always. A file "
        "that defines 'async def agent_func(client, prompt, label)' instead is an OpenAI-API agent: each episode "
        "gets an openai.AsyncOpenAI client on this server's loopback endpoint (rollout_service/openai_api.py). "
        "'gem:ENV_ID[?key=value&...]' plays a GEM environment instead (docs/environments.md)",
        group="agents",
    )
    tool_call_parser: str = flag(
        "",
        "the vLLM tool parser (as vLLM's --tool-call-parser: hermes, llama3_json, mistral, ...) that turns an "
        "OpenAI-API agent's replies into 'tool_calls' when its request has 'tools'; empty: such requests are "
        "refused",
        group="agents",
    )
    agent_env_workers: int = flag(
        0,
        "environment worker processes the agent's episodes run in (rollout_service/env_pool.py: a step that "
        "hangs, crashes, leaks or exits fails its episode and the worker is replaced, never the server); 0: in "
        "this server's own process, on the loop that drives vLLM (comparison and debugging)",
        group="agents",
    )
    agent_episode_timeout_s: float = flag(
        0.0,
        "with --agent_env_workers: an episode's wall time at most, engine time included; past it the episode "
        "fails (0: no limit)",
        group="agents",
    )
    agent_env_worker_memory_mb: float = flag(
        0.0,
        "with --agent_env_workers: a worker whose resident memory passes this many MiB is killed, failing the "
        "episode whose environment code was running (0: no limit; watched, not RLIMIT_AS, which breaks torch's "
        "and tokenizers' address-space reservations)",
        group="agents",
    )
    # -- weights
    weight_transfer_backend: str = flag(
        "auto",
        "how weights arrive from the learner: nccl (GPU), gloo (CPU), auto (nccl when CUDA is available, else gloo)",
        choices=tuple(known_backends()),
        group="weights",
    )
    # -- LoRA (a learner with --lora_sync adapter pushes only its adapter; docs/rollout.md)
    enable_lora: bool = flag(
        False,
        "serve the learner's LoRA adapter (--lora_sync adapter): each push brings an adapter that vLLM serves "
        "beside the base weights; requests keep the adapter they started with",
        group="lora",
    )
    max_lora_rank: int = flag(
        16, "with --enable_lora: the largest adapter rank served (vLLM's max_lora_rank)", group="lora"
    )
    max_loras: int = flag(
        2,
        "with --enable_lora: adapters in one engine batch (vLLM's max_loras): requests of two policy versions run "
        "together across an update; async runs with --max_staleness k have up to k + 1",
        group="lora",
    )
    lora_dir: str = flag(
        "",
        "with --enable_lora: where each pushed adapter is written as a PEFT folder vLLM loads (removed once no request "
        "uses it); default: a temporary folder removed at exit",
        group="lora",
    )
    # -- wire
    controller: str = flag("", "controller address, e.g. tcp://10.0.0.1:5555", required=True, group="wire")
    name: str = flag("", "name at the controller (default rollout-HOST-PID); unique per process", group="wire")
    heartbeat_s: float = flag(2.0, "seconds between heartbeats to the controller", group="wire")
    connect_timeout_s: float = flag(120.0, "give up if the controller does not answer Hello within this", group="wire")
    reconnect_timeout_s: float = flag(
        1800.0,
        "when the controller goes away (a learner restart), keep the engine and say Hello for this long before exiting",
        group="wire",
    )
    auth_dir: str = flag(
        "",
        "folder of the run's CURVE keys (python -m common.auth keygen DIR): encrypted, and only peers holding them are admitted; empty: no authentication",
        group="wire",
    )
    coalesce_ms: float = flag(
        0.0,
        "gather prompts finishing within this many ms into one SampleBatch "
        "(0: one SampleBatch per prompt, as soon as it finishes)",
        group="wire",
    )
    log_level: str = flag("INFO", "logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), group="wire")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"--heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.agent_env_workers < 0 or self.agent_episode_timeout_s < 0 or self.agent_env_worker_memory_mb < 0:
            raise ValueError(
                "--agent_env_workers, --agent_episode_timeout_s and --agent_env_worker_memory_mb must be >= 0, got "
                f"{self.agent_env_workers}, {self.agent_episode_timeout_s}, {self.agent_env_worker_memory_mb}"
            )
        if self.idle_spin_s is not None and self.idle_spin_s < 0:
            raise ValueError(f"--idle_spin_s must be >= 0, got {self.idle_spin_s}")
        if self.enable_lora and (self.max_lora_rank < 1 or self.max_loras < 1):
            raise ValueError(
                f"--max_lora_rank and --max_loras must be >= 1, got {self.max_lora_rank}, {self.max_loras}"
            )
        self.dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(self.dtype, self.dtype)
