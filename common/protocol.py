"""The wire protocol: every message that crosses a socket, in one place.

Frames of one message: ``[tag (1 byte), header (msgpack), tensor buffers...]``
(see ``common/serialization.py`` for the buffers). The tag picks the struct class; the header
is that struct, msgpack-encoded by msgspec, so a message of the wrong shape fails to decode
with a message naming the field. Nothing is ever pickled.

Rules for changing this file:
- bump ``PROTOCOL_VERSION`` when an old peer could misread a new message;
- add new fields at the end, with defaults; never reuse a tag.

Every struct names its sender and receiver. ``call_id`` (on every message) correlates a
reply with its request for RPC-style calls; 0 means "not a call".

Shape glossary: ``N`` samples in a batch, ``L`` total response tokens of the batch
(sum of ``response_lengths``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from common.serialization import TensorEncoder, WireError, make_ext_hook

# 2: typed Hello.capabilities and Ack.info; 3: agent episodes (PromptBatch.agent); 4: an episode's
# outputs in one struct (SampleBatch.episodes), a reward an episode leaves to the reward service (None)
PROTOCOL_VERSION = 4

# Default ceiling for one message (all frames). Experience batches are a few MB; weights do
# not travel over ZMQ (they go over torch.distributed), so anything near this is a bug.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

Tensor = Any  # torch.Tensor on decode; torch.Tensor or numpy.ndarray on encode


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    TAG: ClassVar[int] = 0
    call_id: int = 0


_REGISTRY: dict[int, type[Message]] = {}


def register(cls: type[Message]) -> type[Message]:
    tag = cls.TAG
    if not 0 < tag < 256:
        raise ValueError(f"{cls.__name__}.TAG must be 1..255")
    if tag in _REGISTRY:
        raise ValueError(f"tag {tag} used by both {_REGISTRY[tag].__name__} and {cls.__name__}")
    _REGISTRY[tag] = cls
    return cls


SEED_LIMIT = 2**62  # per-prompt sampling seeds lie in [0, SEED_LIMIT): room for + n, in int64


def _check_len(name: str, seq: Any, n: int, what: str) -> None:
    if len(seq) != n:
        raise ValueError(f"{name} has {len(seq)} entries, expected {n} ({what})")


# --------------------------------------------------------------------------- handshake


class Capabilities(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="kind"):
    """What a service announces in its Hello; one struct per role (the ``kind`` tag)."""

    # How many work items (prompts for a rollout server, requests for a reward service) the
    # controller may keep in flight at this peer.
    capacity: int = 1


class RolloutCapabilities(Capabilities, tag="rollout"):
    model: str = ""
    tp: int = 1  # tensor-parallel size
    workers: int = 1  # vLLM workers: the ranks this server adds to a weight-transfer group
    dtype: str = ""  # the engine's dtype ("float32", "bfloat16"): weights are sent in it
    weight_transfer_backend: str = ""  # "gloo" | "nccl"
    idle_spin_s: float | None = None  # the workers' idle spin after a generation (None: vLLM's own)
    sleep: bool = False  # vLLM sleep mode available (--enable_sleep on a GPU)
    gpu_memory_utilization: float | None = None  # the share of memory the engine was started with
    policy_version: int = 0  # the weights it holds (a server that outlived its learner may be ahead)
    platform: str = "cpu"  # "cpu" | "cuda"
    # The agent it runs episodes with (--agent_func_path): "<file name>:<sha256 of the file, 12
    # hex>"; empty: none. A learner that asks for agent episodes checks it is the one it names.
    agent: str = ""
    max_model_len: int = 0  # prompt plus response (an agent's whole episode) at most; 0: not said
    # --enable_lora: the largest LoRA rank it serves (--max_lora_rank); 0: it serves no adapter
    # (a learner with --lora_sync adapter refuses it at the handshake).
    max_lora_rank: int = 0


class RewardCapabilities(Capabilities, tag="reward"):
    max_pending: int = 0  # requests queued beyond capacity before the service answers busy
    sources: list[str] = []  # "ref", "rm", "func:<file>", "remote", ...: what it scores with
    ref_logprobs: bool = False
    rewards: bool = False
    ref_idle_spin_s: float | None = None  # a vLLM reference engine's idle spin (--ref_backend vllm)
    ref_gpu_memory_utilization: float | None = None  # the share that engine was started with
    teacher_logprobs: bool = False  # it serves a teacher's log-probs (--teacher_pretrain; distillation)
    teacher_topk: int = 0  # and its top-k ids and log-probs per position, K of them (--teacher_topk)


ServiceCapabilities = RolloutCapabilities | RewardCapabilities


@register
class Hello(Message):
    # any service -> controller, first message on a connection.
    TAG: ClassVar[int] = 1
    role: str  # "rollout" | "reward"; its capabilities are the struct of the same kind
    name: str  # human-readable, unique per process (host:pid by default); used in errors
    protocol_version: int = PROTOCOL_VERSION
    capabilities: ServiceCapabilities | None = None  # None: a peer announcing nothing (capacity 1)


@register
class Welcome(Message):
    # controller -> service, answer to Hello. The service must not start work before it.
    TAG: ClassVar[int] = 2
    peer_id: str  # the identity the controller knows this service by
    protocol_version: int = PROTOCOL_VERSION
    policy_version: int = 0  # weights version the controller currently trains
    config: dict[str, Any] = {}  # role-specific settings (e.g. weight-sync rendezvous)


# --------------------------------------------------------------------------- rollout


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    # Part of PromptBatch. Same meaning as vLLM's SamplingParams.
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 128
    stop_token_ids: list[int] = []
    # None: the engine's own seed (unless the batch gives per-prompt seeds). Else prompt P of
    # the batch (its prompt id) is sampled with seed + n * P, its n samples with seed + n * P +
    # 0..n-1 (vLLM seeds sample i of a request with seed + i): reproducible whichever server or
    # batch it lands in, and no two samples of a batch share one random stream.
    seed: int | None = None
    logprobs: bool = True  # return the sampled token's log-prob, per token

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")


class AgentParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    # Part of PromptBatch: run each sample as a multi-turn episode of the server's agent
    # (rollout_service/agent.py, docs/agents.md). sampling.max_new_tokens caps one turn.
    agent: str  # the agent the learner expects (RolloutCapabilities.agent); another is refused
    max_len: int  # prompt plus every turn (actions and environment feedback), in tokens
    max_turns: int = 0  # 0: the environment decides (done), within max_len
    step_timeout_s: float = 60.0  # one reset() or step() of the environment

    def __post_init__(self) -> None:
        if self.max_len < 2:
            raise ValueError(f"agent.max_len must be >= 2, got {self.max_len}")
        if self.max_turns < 0:
            raise ValueError(f"agent.max_turns must be >= 0 (0: no limit), got {self.max_turns}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"agent.step_timeout_s must be > 0, got {self.step_timeout_s}")


@register
class PromptBatch(Message):
    # controller -> rollout server. Generate sampling.n samples for every prompt.
    TAG: ClassVar[int] = 10
    prompt_ids: list[int]  # controller-unique ids, the ledger key
    token_ids: list[list[int]]  # prompt tokens, one list per prompt
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # The server must not start these prompts on weights older than this version
    # (lockstep: the version just pushed; async: 0 = any).
    policy_version: int = 0
    # Empty, or one per prompt: prompt i is sampled with seeds[i] (its n samples with
    # seeds[i] + 0..n-1), whatever sampling.seed says. The controller's choice, so that a
    # prompt keeps its seed across servers, retries and learner restarts (prompt ids do not).
    seeds: list[int] = []
    # Agent episodes instead of single completions (None: plain generation), and the dataset's
    # label of each prompt (empty, or one per prompt) that the agent's reset/step receive.
    agent: AgentParams | None = None
    labels: list[str] = []

    def __post_init__(self) -> None:
        _check_len("token_ids", self.token_ids, len(self.prompt_ids), "one per prompt id")
        if self.labels:
            _check_len("labels", self.labels, len(self.prompt_ids), "one per prompt id, or none")
        if self.seeds:
            _check_len("seeds", self.seeds, len(self.prompt_ids), "one per prompt id, or none")
            if any(not 0 <= s < SEED_LIMIT for s in self.seeds):
                raise ValueError(f"seeds must be in [0, 2**62), got {min(self.seeds)}..{max(self.seeds)}")
        for i, toks in enumerate(self.token_ids):
            if not toks:
                raise ValueError(f"token_ids[{i}] (prompt id {self.prompt_ids[i]}) is empty")


class EpisodeOutputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    # Part of SampleBatch: what its N agent episodes (PromptBatch.agent) produced beside their
    # tokens, one entry per sample. Its mask is one flat frame like the batch's tokens.
    action_mask: Tensor  # (L,) uint8: 1 on tokens the policy sampled, 0 on environment feedback
    # (N,) the agent's reward, summed over the turns; None: the episode left it to the run's
    # reward service (OpenRLHF's executors return None to have the reward model score the sample)
    rewards: list[float | None]
    scores: list[float | None] = []  # (N,) its score (dynamic filtering); None: its reward's
    turns: list[int] = []  # (N,) actions taken
    logs: list[dict[str, float]] = []  # (N,) the last step's extra_logs (numbers only)

    def check(self, n: int, total: int) -> None:
        """Raises ValueError unless it describes ``n`` samples of ``total`` response tokens."""
        _check_tensor("episodes.action_mask", self.action_mask, "int")
        if _numel(self.action_mask) != total:
            raise ValueError(
                f"episodes.action_mask has {_numel(self.action_mask)} entries, response_lengths sum to {total}"
            )
        _check_len("episodes.rewards", self.rewards, n, "one per sample")
        for name in ("scores", "turns", "logs"):
            if getattr(self, name):
                _check_len(f"episodes.{name}", getattr(self, name), n, "one per sample")


@register
class SampleBatch(Message):
    # rollout server -> controller, and controller -> reward service (inside ScoreRequest).
    # Columnar: N samples; response tokens of all samples concatenated.
    TAG: ClassVar[int] = 11
    prompt_ids: list[int]  # (N,)
    sample_indices: list[int]  # (N,) 0..n-1 within its prompt
    response_lengths: list[int]  # (N,)
    response_ids: Tensor  # (L,) int32/int64
    logprobs: Tensor | None = None  # (L,) float32, sampling log-probs (after temperature)
    finish_reasons: list[str] = []  # (N,) "stop" | "length" | "abort"
    policy_versions: list[int] = []  # (N,) version of the weights that *started* the sample
    prompt_token_ids: list[list[int]] | None = None  # (N,) optional echo of the prompt
    server: str = ""  # name of the server that produced the batch
    # Agent episodes (PromptBatch.agent; None: plain samples): the response is every token after
    # the episode's prompt (prompt_token_ids, then required: an agent may rewrite the observation
    # it starts from), the policy's actions and the environment's feedback interleaved.
    episodes: EpisodeOutputs | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        _check_len("sample_indices", self.sample_indices, n, "one per sample")
        _check_len("response_lengths", self.response_lengths, n, "one per sample")
        if self.finish_reasons:
            _check_len("finish_reasons", self.finish_reasons, n, "one per sample")
        if self.policy_versions:
            _check_len("policy_versions", self.policy_versions, n, "one per sample")
        if self.prompt_token_ids is not None:
            _check_len("prompt_token_ids", self.prompt_token_ids, n, "one per sample")
        _check_tensor("response_ids", self.response_ids, "int")
        if self.logprobs is not None:
            _check_tensor("logprobs", self.logprobs, "float")
        total = sum(self.response_lengths)
        if any(x < 0 for x in self.response_lengths):
            raise ValueError("response_lengths must be >= 0")
        if _numel(self.response_ids) != total:
            raise ValueError(f"response_ids has {_numel(self.response_ids)} tokens, response_lengths sum to {total}")
        if self.logprobs is not None and _numel(self.logprobs) != total:
            raise ValueError(f"logprobs has {_numel(self.logprobs)} entries, response_lengths sum to {total}")
        if self.episodes is not None:
            self.episodes.check(n, total)
            if self.prompt_token_ids is None:
                raise ValueError("episodes (agent episodes) need prompt_token_ids: each episode's own prompt")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def split_responses(self) -> list[Any]:
        """Per-sample views of ``response_ids`` (a list of N 1-D tensors)."""
        return list(_as_tensor(self.response_ids).split(self.response_lengths))

    def split_logprobs(self) -> list[Any]:
        if self.logprobs is None:
            raise ValueError("this SampleBatch carries no logprobs")
        return list(_as_tensor(self.logprobs).split(self.response_lengths))


@register
class ScoreRequest(Message):
    # controller -> reward service. Score every sample of `samples` (its tokens: the controller
    # leaves the sampler's log-probs out, which no scorer reads).
    TAG: ClassVar[int] = 12
    samples: SampleBatch
    prompts: list[str] = []  # (N,) prompt text per sample, for function/remote rewards
    labels: list[Any] = []  # (N,) ground truth per sample (None when the dataset has none)
    queries: list[str] = []  # (N,) prompt + response text, OpenRLHF's `queries`


@register
class ScoredBatch(Message):
    # reward service -> controller. Same order as the request's samples.
    TAG: ClassVar[int] = 13
    prompt_ids: list[int]  # (N,)
    sample_indices: list[int]  # (N,)
    rewards: Tensor  # (N,) float32; NaN where failed
    ref_logprobs: Tensor | None = None  # (L,) float32, reference log-probs of response tokens
    failed: list[str | None] = []  # (N,) reason a sample could not be scored; None = ok
    scores: Tensor | None = None  # (N,) float32, e.g. raw accuracy for logging (OpenRLHF `scores`)
    extra_logs: dict[str, list[float]] = {}  # per-sample metrics to log (name -> (N,))
    server: str = ""
    # (L,) float32, the teacher's log-probs of the response tokens (on-policy distillation), laid
    # out as ref_logprobs; None: the service has no teacher
    teacher_logprobs: Tensor | None = None
    # (L, K): the teacher's K most likely ids at each response position (int32) and their
    # log-probs (float32), most likely first (reward_service --teacher_topk K); None: not asked
    teacher_topk_ids: Tensor | None = None
    teacher_topk_logprobs: Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        _check_len("sample_indices", self.sample_indices, n, "one per sample")
        _check_tensor("rewards", self.rewards, "float")
        for name in ("ref_logprobs", "teacher_logprobs"):
            if getattr(self, name) is not None:
                _check_tensor(name, getattr(self, name), "float", ndim=None)
        if self.teacher_topk_logprobs is not None:
            _check_tensor("teacher_topk_logprobs", self.teacher_topk_logprobs, "float", ndim=2)
        if self.teacher_topk_ids is not None:
            _check_tensor("teacher_topk_ids", self.teacher_topk_ids, "int", ndim=2)
        if self.scores is not None:
            _check_tensor("scores", self.scores, "float")
        if _numel(self.rewards) != n:
            raise ValueError(f"rewards has {_numel(self.rewards)} entries, expected {n}")
        if self.failed:
            _check_len("failed", self.failed, n, "one per sample")
        if self.scores is not None and _numel(self.scores) != n:
            raise ValueError(f"scores has {_numel(self.scores)} entries, expected {n}")


# --------------------------------------------------------------------------- control


@register
class Heartbeat(Message):
    # any service -> controller, every few seconds; silence past the deadline = dead peer.
    TAG: ClassVar[int] = 20
    name: str
    seq: int = 0
    policy_version: int = 0
    stats: dict[str, float] = {}  # e.g. {"in_flight": 12, "tokens_per_s": 930.0}


@register
class Error(Message):
    # either direction. With call_id != 0: the answer to that call failed, the peer lives on.
    # code "fatal": the sender is going down (a DEAD notice); peers should fail fast.
    TAG: ClassVar[int] = 21
    code: str  # "bad_request" | "timeout" | "internal" | "fatal" | ...
    message: str
    prompt_ids: list[int] = []  # work that this error concerns, when there is any


@register
class Shutdown(Message):
    # controller -> service: finish (or drop) in-flight work and exit 0.
    TAG: ClassVar[int] = 22
    reason: str = ""


class AckInfo(msgspec.Struct, kw_only=True, tag_field="kind"):
    """What an Ack reports beside success, one struct per call that reports something."""


class WorkersJoined(AckInfo, tag="workers_joined"):
    workers: int  # reply to WeightSyncInit: the vLLM workers that joined the group


class WeightsLoaded(AckInfo, tag="weights_loaded"):
    seconds: float  # reply to WeightUpdate: receiving and loading took this long


class UpdateFinished(AckInfo, tag="update_finished"):
    policy_version: int  # reply to WeightUpdateFinish: the version the server now samples with
    prefix_cache_reset: bool


class ShutdownAccepted(AckInfo, tag="shutdown"):
    unanswered: int  # reply to Shutdown: work in flight (prompts, score requests) that will not be answered


@register
class Ack(Message):
    # reply to a call that succeeded; `info` says what it did where the call reports something.
    TAG: ClassVar[int] = 23
    info: WorkersJoined | WeightsLoaded | UpdateFinished | ShutdownAccepted | None = None


def version_error(hello: Hello) -> Error | None:
    """The controller's check of a Hello: an Error to answer with, or None if compatible."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return Error(
            code="version_mismatch",
            message=f"{hello.name} speaks protocol {hello.protocol_version}, controller speaks "
            f"{PROTOCOL_VERSION}: run the same rayless version on every node",
        )
    kind = type(hello.capabilities).__struct_config__.tag if hello.capabilities is not None else None
    if kind is not None and kind != hello.role:
        return Error(code="bad_request", message=f"{hello.name} says it is a {hello.role} with {kind} capabilities")
    return None


# --------------------------------------------------------------------------- codec


def _numel(t: Any) -> int:
    n = getattr(t, "numel", None)
    return int(n()) if callable(n) else int(t.size)


def _check_tensor(field: str, t: Any, kind: str, ndim: int | None = 1) -> None:
    """Tensor fields are typed Any for msgspec; check here that a tensor (or, on the sending
    side, a numpy array) of the right kind arrived, so a list or string fails at the socket."""
    import numpy as np

    if isinstance(t, np.ndarray):
        ok_kind = {"int": "iu", "float": "f"}[kind]
        good = t.dtype.kind in ok_kind
    else:
        import torch

        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{field} must be a tensor, got {type(t).__name__}")
        good = t.is_floating_point() if kind == "float" else (not t.is_floating_point() and t.dtype != torch.bool)
    if not good:
        raise ValueError(f"{field} must hold {kind} values, got dtype {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{field} must be {ndim}-D, got shape {tuple(t.shape)}")


def _as_tensor(t: Any):
    import torch

    return t if isinstance(t, torch.Tensor) else torch.as_tensor(t)


def message_types() -> dict[int, type[Message]]:
    return dict(_REGISTRY)


class Codec:
    """Message <-> frames. One per socket-owning thread (encoders are not thread-safe)."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._enc = TensorEncoder()
        self._bufs: list[Any] = []
        self._hook = make_ext_hook(lambda: self._bufs)
        self._decoders: dict[int, msgspec.msgpack.Decoder] = {}

    def encode(self, msg: Message) -> list[Any]:
        tag = type(msg).TAG
        if _REGISTRY.get(tag) is not type(msg):
            raise TypeError(f"{type(msg).__name__} is not a registered message type")
        header, buffers = self._enc.encode(msg)
        return [bytes((tag,)), header, *buffers]

    def decode(self, frames: list[Any]) -> Message:
        """Frames (bytes, memoryview or zmq.Frame) -> message. Raises WireError on anything bad."""
        if len(frames) < 2:
            raise WireError(f"truncated message: {len(frames)} frame(s), need at least tag + header")
        bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        size = sum(memoryview(b).nbytes for b in bufs)
        if size > self.max_message_bytes:
            raise WireError(f"message of {size} bytes exceeds the limit of {self.max_message_bytes}")
        tag_frame = bytes(bufs[0])
        if len(tag_frame) != 1:
            raise WireError(f"bad tag frame of {len(tag_frame)} bytes (expected 1)")
        cls = _REGISTRY.get(tag_frame[0])
        if cls is None:
            raise WireError(f"unknown message type tag {tag_frame[0]}")
        self._bufs = bufs[2:]
        try:
            dec = self._decoders.get(cls.TAG)
            if dec is None:
                dec = self._decoders[cls.TAG] = msgspec.msgpack.Decoder(cls, ext_hook=self._hook)
            return dec.decode(bufs[1])
        except WireError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            raise WireError(f"bad {cls.__name__}: {e}") from None
        finally:
            self._bufs = []


# --------------------------------------------------------------------------- rollout control
# Tags 30-49. Every one of these is a call: the server answers with the same call_id, an Ack
# (or the named reply) on success, an Error on failure, and stays up either way. The weight
# steps mirror vLLM's weight-transfer API (init / start / update / finish); the tensors
# themselves never cross ZMQ, they go over the group WeightSyncInit forms
# (common/weights/publisher.py, docs/rollout.md).


@register
class WeightSyncInit(Message):
    # controller (learner rank 0) -> rollout server. Join a weight-transfer group with the
    # learner: the learner is rank 0 and hosts the TCPStore named in init_info; this server's
    # vLLM workers take ranks 1..k. Replaces any group the server already had. Reply:
    # Ack(info=WorkersJoined(workers=k)) once every rank has joined.
    TAG: ClassVar[int] = 30
    backend: str  # "gloo" (CPU) | "nccl" (GPU); must equal the server's --weight_transfer_backend
    # vLLM's init_info for that backend: master_address, master_port, world_size, rank_offset,
    # packed_buffer_size_bytes, ... (passed to AsyncLLM.init_weight_transfer_engine as is).
    init_info: dict[str, Any] = {}
    timeout_s: float = 120.0  # how long the server waits for the group to form


@register
class WeightUpdateStart(Message):
    # controller -> rollout server. Pause generation keeping in-flight requests, and open an
    # update (vLLM start_weight_update). New prompts wait until WeightUpdateFinish. Reply: Ack.
    TAG: ClassVar[int] = 31
    policy_version: int  # the version being pushed (for logs and errors)
    # Only a LoRA adapter follows (WeightUpdate.lora): nothing pauses, requests keep the
    # adapter they started with, those admitted after WeightUpdateFinish get the new one.
    adapter_only: bool = False


class LoraAdapter(msgspec.Struct, kw_only=True, omit_defaults=True):
    # What a server needs beside the tensors to serve a LoRA adapter (PEFT's adapter_config).
    rank: int
    alpha: float
    target_modules: list[str]  # the adapted modules' last names ("q_proj", "down_proj", ...)

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not self.target_modules:
            raise ValueError(f"lora: rank >= 1, alpha > 0 and target modules, got {self}")


@register
class WeightUpdate(Message):
    # controller -> rollout server. Receive the weights described here over the group, in this
    # order, then load them (vLLM update_weights). Reply: Ack(info=WeightsLoaded(...)) once loaded.
    TAG: ClassVar[int] = 32
    names: list[str]  # checkpoint (HF) parameter names (tied ones: see aliases)
    dtype_names: list[str]  # torch dtype names ("float32", "bfloat16"), the engine's dtype
    shapes: list[list[int]]
    # Tied parameters sent once: {name to load too: the name in `names` whose tensor it is},
    # e.g. {"lm_head.weight": "model.embed_tokens.weight"}. Empty: every name is in `names`.
    aliases: dict[str, str] = {}
    # Set: the tensors named with ".lora_" are a LoRA adapter under PEFT's saved names, for the
    # server to serve beside its weights (--lora_sync adapter); the others (if any: a joiner's
    # base weights, sent first) load into the weights as always.
    lora: LoraAdapter | None = None
    # "": plain tensors, loaded as they come. "full" / "delta" (--weight_sync delta,
    # common/weights/delta.py): whole tensors the server keeps as its base, or the changes to
    # that base ("NAME#idx" / "NAME#val", or NAME whole); either ends with "#digest", which the
    # server checks against its base before loading. aliases come with a full push only.
    encoding: str = ""

    def __post_init__(self) -> None:
        if self.encoding not in ("", "full", "delta"):
            raise ValueError(f"encoding: unknown {self.encoding!r} (known: '', 'full', 'delta')")
        _check_len("dtype_names", self.dtype_names, len(self.names), "one per name")
        _check_len("shapes", self.shapes, len(self.names), "one per name")
        if self.lora is not None and not any(".lora_" in n for n in self.names):
            raise ValueError("lora: no adapter tensor (a name with .lora_A. or .lora_B.) among names")
        sent = set(self.names)
        for alias, name in self.aliases.items():
            if name not in sent or alias in sent:
                raise ValueError(f"aliases: {alias!r} -> {name!r} must name a sent tensor, and not be one itself")


@register
class WeightUpdateFinish(Message):
    # controller -> rollout server. Close the update (vLLM finish_weight_update), reset the
    # prefix cache, set the server's policy version, resume generation. Samples started
    # before keep their old version. Reply: Ack(info=UpdateFinished(...)).
    TAG: ClassVar[int] = 33
    policy_version: int


@register
class WeightSyncClose(Message):
    # controller -> rollout server. Leave the weight-transfer group (the learner is dropping
    # this server or re-forming the group). Reply: Ack.
    TAG: ClassVar[int] = 34


@register
class Pause(Message):
    # controller -> rollout server. Stop scheduling; in-flight requests are kept and continue
    # on Resume. Reply: Ack.
    TAG: ClassVar[int] = 35


@register
class Resume(Message):
    # controller -> rollout server. Reply: Ack.
    TAG: ClassVar[int] = 36


@register
class Sleep(Message):
    # controller -> rollout server. Free accelerator memory (vLLM sleep mode; level 1 keeps
    # weights in host memory, 2 drops them). In-flight requests are aborted (finish "abort").
    # Reply: Ack, or Error(code="not_supported") where the platform has no sleep mode (CPU) or
    # the server was started without --enable_sleep.
    TAG: ClassVar[int] = 37
    level: int = 1


@register
class WakeUp(Message):
    # controller -> rollout server. Reply: Ack (or Error(code="not_supported"), as Sleep).
    TAG: ClassVar[int] = 38
    tags: list[str] | None = None  # None: everything; or e.g. ["weights"] then ["kv_cache"]


@register
class GetHealth(Message):
    # controller -> rollout server. Reply: Health.
    TAG: ClassVar[int] = 39


@register
class Health(Message):
    # rollout server -> controller, the answer to GetHealth.
    TAG: ClassVar[int] = 40
    name: str
    state: str  # "serving" | "paused" | "updating" | "update_failed" | "sleeping"
    policy_version: int = 0
    # e.g. {"in_flight": 12, "waiting": 3, "tokens_per_s": 930.0, "generated_tokens": 1e5}
    stats: dict[str, float] = {}


@register
class Abort(Message):
    # controller -> rollout server; not a call (no reply). Drop these prompts: those waiting to
    # start are never started, those generating are aborted in vLLM (AsyncLLM.abort) and their
    # samples never sent. A prompt already finished may still arrive: the controller drops it
    # as a duplicate (it re-queues aborted prompts under new ids). The async schedule sends it
    # before a weight push, for prompts that would exceed --max_staleness.
    TAG: ClassVar[int] = 41
    prompt_ids: list[int] = []
    reason: str = ""
