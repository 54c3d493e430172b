"""``RolloutCore``: one vLLM ``AsyncLLM`` turning prompt tokens into samples. No sockets.

The process wrapper (``rollout_service/server.py``) feeds it PromptBatches from the controller;
tests drive it in-process. Token in, token out: prompts arrive as token ids and samples leave
as token ids with the log-prob vLLM sampled each token with (``logprobs_mode=
"processed_logprobs"``: after temperature and top-k/top-p, which is what an importance-sampling
correction must compare against), a finish reason and the policy version of the weights that
produced the first token.

Admission and versions. A prompt is admitted (handed to vLLM) only when nothing holds the gate
(a pause, a weight update, sleep, a failed update) and the server's weights are at least the
version the controller asked for; until then it waits here, not in vLLM. vLLM labels every
output token with the weight version that sampled it (``finish_weight_update(weight_version)``),
and a sample's ``policy_version`` is the label of its first token. Requests in flight when an
update starts are kept (vLLM pause mode "keep") and continue on the new weights afterwards;
their version says they started on the old ones.

A controller lost mid-push. A learner killed between WeightUpdateStart and WeightUpdateFinish
leaves an update open that nobody will finish, and a group whose other end is gone. When the
server finds its controller gone, or a new controller welcomes it, ``abort_weight_sync`` marks
the open update failed (the weights may be half-loaded: nothing is served until a complete
update lands, which the new controller pushes before any prompt), drops the group, and bumps
the weight epoch: a weight call of the old controller still queued behind the update lock is
refused when its turn comes instead of running against a learner that is gone. A receive that
was already running cannot be interrupted (it is a collective inside vLLM's worker), but it
does not need to be: gloo raises "Connection closed by peer" within milliseconds of the
learner's death. What did hang was the rendezvous: a worker that tries to join a store nobody
listens on any more (the learner died, or gave up on us and dropped its store) retries the
connect until its timeout, about three times over, holding the worker and the update lock
while the restarted learner's own WeightSyncInit waits behind it and times out in turn. So a
WeightSyncInit runs only within the learner's own deadline: the worker is given what is left of
``timeout_s`` after the call waited for the lock, and one that waited it all out is answered
with an error at once (the learner has given up on that group; it asks again).

LoRA adapters (``--enable_lora``, a learner with ``--lora_sync adapter``). A push may bring
only an adapter (``WeightUpdateStart.adapter_only``): nothing pauses; the first worker writes
the tensors as a PEFT folder, and at WeightUpdateFinish the engine loads it (``add_lora``) and
every request admitted from then on carries it. A request keeps the adapter it was admitted
with to its last token, so its version is its admission's (vLLM's spans label the base
weights, which an adapter push leaves alone). An adapter no request uses any more, and that is
not the current one, is removed from the engine and its folder deleted. A push of whole
weights with an adapter (a joiner, a restarted learner) loads the base, then serves the
adapter; one without (a learner pushing merged weights) serves the weights alone.

Stale KV. After every update the prefix cache is reset. vLLM refuses that reset while kept
requests still hold KV blocks, so prompts are also salted with the version
(``cache_salt="rayless-v{N}"``): a block computed under one version can never be a prefix hit
for a request admitted under another.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from common import protocol as P
from common.vllm_memory import EngineStartRefused, check_start, choose_share, start_refusal
from common.vllm_quiet import allow_engine_exit_time, shutdown_async_llm
from common.vllm_spin import IDLE_SPIN_ENV
from common.weights import resolve_backend
from rollout_service.config import RolloutConfig

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
GPU_MEMORY_SHARE = 0.85  # --gpu_memory_utilization on a GPU when not given (CPU: common/vllm_memory.py)
MEMORY_FLAG = "--gpu_memory_utilization"


_NO_SLEEP_ON_CPU = "vLLM has no sleep mode on CPU (there is no device memory to free)"


def _sleep_mode_available() -> bool:
    """vLLM's sleep mode needs its CUDA memory allocator (vLLM refuses it on other platforms)."""
    import torch

    return torch.cuda.is_available()


class NotSupported(RuntimeError):
    """The request is valid but this server cannot do it (e.g. sleep mode on CPU)."""


class BadRequest(ValueError):
    """The request is malformed or contradicts this server's configuration."""


@dataclass
class GeneratedSample:
    """One completion of a prompt as vLLM produced it, before any reward; or one agent episode
    (``episode`` set: its own prompt, action mask, reward, turns)."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "abort"
    policy_version: int  # version of the weights that sampled the first token (the first action's)
    episode: Any = None  # rollout_service.agent.Episode of an agent sample


@dataclass
class PromptResult:
    prompt_id: int
    prompt_token_ids: list[int]
    samples: list[GeneratedSample]  # sampling.n of them, by sample index


class AgentFailed(Exception):
    """An agent episode failed (the environment's fault, not the server's): the prompt is answered
    with an error the controller re-issues."""


@dataclass
class _Meter:
    """Generated tokens over a sliding window, for tokens/s."""

    window_s: float = 10.0
    total: int = 0
    events: deque = field(default_factory=deque)

    def add(self, n: int) -> None:
        now = time.monotonic()
        self.total += n
        self.events.append((now, n))
        while self.events and now - self.events[0][0] > self.window_s:
            self.events.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        while self.events and now - self.events[0][0] > self.window_s:
            self.events.popleft()
        if not self.events:
            return 0.0
        span = max(now - self.events[0][0], 1.0)
        return sum(n for _, n in self.events) / span


class RolloutCore:
    def __init__(self, cfg: RolloutConfig) -> None:
        self.cfg = cfg
        self.backend = resolve_backend(cfg.weight_transfer_backend)
        self.llm: AsyncLLM | None = None  # start() makes it, shutdown() drops it (see ``engine``)
        self.version = 0
        # No prompt starts on weights older than this (the controller's version at Welcome).
        self.version_floor = 0
        self.workers = cfg.tensor_parallel_size  # vLLM worker processes = ranks in a weight group
        self.engine_dtype = ""
        self.worker_idle_spin_s: float | None = None  # what the workers' queues spin (reported at start)
        self.memory_share: float | None = cfg.gpu_memory_utilization  # None until resolve_memory_share()
        self._holds: set[str] = set()  # reasons the gate is closed: pause, update, sleep, update_failed
        self._changed = asyncio.Condition()  # gate or version changed
        self._update_lock = asyncio.Lock()  # one weight-update step at a time
        self._admission = asyncio.Lock()  # orders adds against pauses (see generate)
        self._update_open = False
        self._group_open = False  # a weight group was formed and not yet shut down
        self._weight_epoch = 0  # bumped by abort_weight_sync: older weight calls are refused
        self._ids = itertools.count()
        self._in_flight: dict[str, int] = {}  # vLLM request id -> prompt id
        self._waiting = 0
        self._meter = _Meter()
        self.counters = {
            "prompts": 0,
            "samples": 0,
            "aborted": 0,
            "updates": 0,
            "failed_updates": 0,
            "samples_across_updates": 0,  # kept in flight through an update: tokens of 2+ versions
            "adapters": 0,  # LoRA adapters loaded (--enable_lora)
            "aborted_by_controller": 0,  # prompts the controller dropped (P.Abort: too stale to train on)
            "episodes": 0,  # agent episodes finished (each is a sample)
            "agent_turns": 0,
            "failed_episodes": 0,  # the environment raised, hung or answered garbage
            # An episode's turns after its first: their input tokens and the share of them vLLM's
            # prefix cache held (every turn of an episode runs on this engine: close to all of
            # it, less what a weight update in between made stale).
            "agent_later_turn_tokens": 0,
            "agent_later_turn_cached": 0,
        }
        # --enable_lora: the adapter requests are admitted with (None: the weights alone), the
        # adapters registered with the engine (LoRA id -> folder), and how many requests run with each.
        self._lora: Any = None
        self._loras: dict[int, Path] = {}
        self._lora_users: Counter[int] = Counter()
        self._lora_ids = itertools.count(1)
        self._lora_root: Path | None = None
        self._lora_root_ours = False  # a temporary folder of ours: removed at shutdown
        self._retiring: set[asyncio.Future] = set()
        self._update_adapter_only = False
        self._pending_adapter: tuple[int, Path] | None = None  # received in the open update: served from its finish
        self.agent: Any = None  # the --agent_func_path executor, loaded by start()
        self.agent_identity = ""
        self.tokenizer: Any = None  # the model's HF tokenizer, for agent episodes

    # ------------------------------------------------------------------ lifecycle
    def engine_args(self):
        from vllm.engine.arg_utils import AsyncEngineArgs

        c = self.cfg
        kwargs: dict[str, Any] = dict(
            model=c.model,
            tensor_parallel_size=c.tensor_parallel_size,
            dtype=c.dtype,
            seed=c.seed,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            enforce_eager=c.enforce_eager,
            gpu_memory_utilization=self.resolve_memory_share(),
            enable_prefix_caching=c.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="rollout_service.worker_ext.RolloutWorkerExtension",
            weight_transfer_config={"backend": self.backend},
        )
        if c.enable_lora:
            # The CPU cache holds one more than a batch: an adapter still in use after the next
            # arrives is not reloaded from its folder for every step.
            kwargs.update(
                enable_lora=True, max_lora_rank=c.max_lora_rank, max_loras=c.max_loras, max_cpu_loras=c.max_loras + 1
            )
        if c.enable_sleep:
            if _sleep_mode_available():
                kwargs["enable_sleep_mode"] = True
            else:  # vLLM refuses the engine outright; serve without it and answer Sleep with why
                log.warning("--enable_sleep: %s; Sleep/WakeUp will be answered not_supported", _NO_SLEEP_ON_CPU)
        chunked = c.enable_chunked_prefill
        if chunked is None and self.backend == "gloo":  # a CPU engine
            # vLLM 0.32 on CPU: a chunked prefill rewinds the request's generator, which a CPU
            # generator cannot do ("CPU Generator does not use offset"): the engine dies on the
            # first seeded prompt that gets chunked. Whole-prompt prefills avoid it.
            chunked = False
        if chunked is not None:
            kwargs["enable_chunked_prefill"] = chunked
        return AsyncEngineArgs(**kwargs)

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.cfg.agent_func_path:  # before the engine: a bad agent file fails in a second, naming it
            from transformers import AutoTokenizer

            from rollout_service.agent import load_agent

            self.agent, self.agent_identity = load_agent(self.cfg.agent_func_path)
            self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model)
            log.info("agent %s from %s", self.agent_identity, self.cfg.agent_func_path)
        if self.cfg.enable_lora:
            self._lora_root_ours = not self.cfg.lora_dir
            root = self.cfg.lora_dir or tempfile.mkdtemp(prefix="rayless-lora-")
            self._lora_root = Path(root)
            self._lora_root.mkdir(parents=True, exist_ok=True)
        if self.cfg.idle_spin_s is not None:  # read by rollout_service.worker_ext in the workers vLLM spawns
            os.environ[IDLE_SPIN_ENV] = str(self.cfg.idle_spin_s)
        allow_engine_exit_time()  # read by the EngineCore: its workers' time to exit (common/vllm_quiet.py)
        # vLLM-CPU's memory check, before any of its processes exist: a refusal is one line.
        share = self.resolve_memory_share()
        check_start(share, model=self.cfg.model, flag=MEMORY_FLAG, who=self._who)
        for attempt in range(1, self.cfg.engine_start_attempts + 1):
            try:
                self.llm = AsyncLLM.from_engine_args(self.engine_args())
                break
            except RuntimeError as e:
                # vLLM 0.32's EngineCore asserts if its input thread is not ready within 10 s,
                # which happens on an overloaded host (seen on a busy 2-core CI box): retry.
                # Not when its worker refused for memory (that error is in its own process; the
                # check is read again here): the same start would be refused the same way.
                if "initialization failed" not in str(e):
                    raise
                refused = start_refusal(share, model=self.cfg.model, flag=MEMORY_FLAG, who=self._who)
                if refused is not None:
                    raise EngineStartRefused(refused) from None
                if attempt == self.cfg.engine_start_attempts:
                    raise
                log.warning(
                    "vLLM engine failed to start (attempt %d of %d): %s; retrying",
                    attempt,
                    self.cfg.engine_start_attempts,
                    e,
                )
        engines = await self.engine.collective_rpc("rayless_weight_transfer_engine")
        if not all(engines):
            raise RuntimeError(f"vLLM workers have no weight-transfer engine for backend {self.backend!r}: {engines}")
        self.workers = len(engines)
        self.engine_dtype = str(self.engine.model_config.dtype).removeprefix("torch.")
        self.worker_idle_spin_s = (await self.engine.collective_rpc("rayless_idle_spin_s"))[0]
        await self.engine.update_weight_version(str(self.version))
        log.info(
            "engine up: %s, %d worker(s), dtype %s, weight transfer %s (%s), idle spin %s s",
            self.cfg.model,
            self.workers,
            self.engine_dtype,
            self.backend,
            engines[0],
            self.worker_idle_spin_s,
        )

    @property
    def engine(self) -> AsyncLLM:
        """``llm``, for the code that runs between ``start()`` and ``shutdown()``."""
        if self.llm is None:
            raise RuntimeError("the vLLM engine is not running (start() not called, or shut down)")
        return self.llm

    def resolve_memory_share(self) -> float:
        """--gpu_memory_utilization, else this host's default (``common.vllm_memory``), once."""
        if self.memory_share is None:
            self.memory_share = choose_share(
                None, GPU_MEMORY_SHARE, model=self.cfg.model, flag=MEMORY_FLAG, who=self._who
            )
        return self.memory_share

    @property
    def _who(self) -> str:
        return self.cfg.name or "rollout server"

    async def shutdown(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await shutdown_async_llm(llm)  # its output handler first: no EngineDeadError after a clean stop
        if self._lora_root is not None:
            for folder in self._loras.values():
                shutil.rmtree(folder, ignore_errors=True)
            if self._lora_root_ours:
                shutil.rmtree(self._lora_root, ignore_errors=True)

    def capabilities(self) -> P.RolloutCapabilities:
        import torch

        return P.RolloutCapabilities(
            capacity=self.cfg.max_num_seqs,
            model=self.cfg.model,
            tp=self.cfg.tensor_parallel_size,
            workers=self.workers,
            dtype=self.engine_dtype or "",
            weight_transfer_backend=self.backend,
            idle_spin_s=self.worker_idle_spin_s,
            sleep=self.sleep_supported(),
            gpu_memory_utilization=self.memory_share,
            policy_version=self.version,
            platform="cuda" if torch.cuda.is_available() else "cpu",
            agent=self.agent_identity,
            max_model_len=self.cfg.max_model_len,
            max_lora_rank=self.cfg.max_lora_rank if self.cfg.enable_lora else 0,
        )

    # ------------------------------------------------------------------ generation
    def _vllm_params(self, sp: P.SamplingParams, prompt_id: int, seed: int | None = None):
        """vLLM's parameters for one prompt. ``seed``: the prompt's own (``PromptBatch.seeds``);
        else ``sp.seed + n * prompt_id``; else none (the engine's generator). vLLM samples the
        request's i-th sample with seed + i."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=sp.n,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=0 if sp.top_k in (-1, 0) else sp.top_k,
            max_tokens=sp.max_new_tokens,
            stop_token_ids=list(sp.stop_token_ids),
            seed=seed if seed is not None else None if sp.seed is None else sp.seed + sp.n * prompt_id,
            logprobs=0 if sp.logprobs else None,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def validate(self, token_ids: list[int], sp: P.SamplingParams) -> None:
        """Raises BadRequest for a prompt this engine cannot serve (checked before queueing, so
        the controller hears about it at once and not after the prompt reaches vLLM)."""
        vocab = self.llm.model_config.get_vocab_size() if self.llm is not None else None
        if not token_ids:
            raise BadRequest("empty prompt")
        if vocab is not None and any(not 0 <= t < vocab for t in token_ids):
            raise BadRequest(f"prompt token ids outside the vocabulary [0, {vocab})")
        # As vLLM: the prompt must leave room for one token; a response that reaches the limit
        # ends early with finish reason "length" (max_new_tokens is an upper bound, not a promise).
        if len(token_ids) >= self.cfg.max_model_len:
            raise BadRequest(
                f"prompt of {len(token_ids)} tokens leaves no room under --max_model_len {self.cfg.max_model_len}"
            )

    async def _admit(self, min_version: int) -> None:
        min_version = max(min_version, self.version_floor)
        async with self._changed:
            self._waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._holds and self.version >= min_version)
            finally:
                self._waiting -= 1

    async def generate(
        self,
        prompt_id: int,
        token_ids: list[int],
        sampling: P.SamplingParams,
        min_version: int = 0,
        *,
        seed: int | None = None,
        agent: P.AgentParams | None = None,
        label: str | None = None,
    ) -> PromptResult:
        """All ``sampling.n`` samples of one prompt, once the last of them finishes (with
        ``agent``: ``sampling.n`` episodes of this server's agent)."""
        self.validate(token_ids, sampling)
        params = self._vllm_params(sampling, prompt_id, seed)
        if agent is not None:
            return await self._episodes(prompt_id, token_ids, sampling, params, min_version, agent, label)
        out, admitted = await self._request(prompt_id, token_ids, params, min_version)
        samples = [self._sample(o, admitted, sampling.logprobs) for o in sorted(out.outputs, key=lambda o: o.index)]
        self.counters["prompts"] += 1
        self.counters["samples"] += len(samples)
        self.counters["aborted"] += sum(s.finish_reason == "abort" for s in samples)
        self._meter.add(sum(len(s.token_ids) for s in samples))
        return PromptResult(prompt_id, list(token_ids), samples)

    async def _episodes(
        self,
        prompt_id: int,
        token_ids: list[int],
        sampling: P.SamplingParams,
        params: Any,
        min_version: int,
        agent: P.AgentParams,
        label: str | None,
    ) -> PromptResult:
        """``sampling.n`` episodes of this server's agent from one prompt, concurrently, every
        turn on this engine (its prefix cache holds the episode's earlier turns). An episode
        that fails (the environment raised, hung, answered garbage) fails the prompt: counted,
        logged with its id, and answered as an error the controller re-issues (or drops)."""
        from rollout_service.agent import EpisodeError, TurnEngine, run_episode

        if self.agent is None:
            raise BadRequest("agent episodes asked of a server that runs no agent (start it with --agent_func_path)")
        if agent.agent != self.agent_identity:
            raise BadRequest(f"the learner's agent is {agent.agent}; this server runs {self.agent_identity}")
        if agent.max_len > self.cfg.max_model_len:
            raise BadRequest(
                f"agent.max_len {agent.max_len} exceeds this server's --max_model_len {self.cfg.max_model_len}"
            )
        if len(token_ids) >= agent.max_len:
            raise BadRequest(f"prompt of {len(token_ids)} tokens leaves no room under agent.max_len {agent.max_len}")
        prompt_text = self.tokenizer.decode(token_ids, skip_special_tokens=False)

        vocab = self.engine.model_config.get_vocab_size()

        async def request(toks: list[int], turn_params: Any) -> tuple[Any, int]:
            if any(not (isinstance(t, int) and 0 <= t < vocab) for t in toks):
                raise EpisodeError(f"the agent asked to generate from token ids outside the vocabulary [0, {vocab})")
            out, admitted = await self._request(prompt_id, toks, turn_params, min_version)
            o = out.outputs[0]
            self._weight_spans(o)
            self._meter.add(len(o.token_ids))
            return out, admitted

        async def one(i: int) -> GeneratedSample:
            engine = TurnEngine(
                request,
                self._turn_params,
                prompt_token_ids=token_ids,
                max_len=agent.max_len,
                max_turns=agent.max_turns,
                decode=self._action_text,
            )
            first = self._vllm_params(msgspec.structs.replace(sampling, n=1), prompt_id)
            # vLLM seeds sample i of a request with seed + i; each episode is requests of n=1.
            first.seed = None if params.seed is None else (params.seed + i) % P.SEED_LIMIT
            ep = await run_episode(
                self.agent,
                engine,
                prompt_text=prompt_text,
                label=label,
                sampling_params=first,
                tokenizer=self.tokenizer,
                step_timeout_s=agent.step_timeout_s,
            )
            lps = ep.logprobs if sampling.logprobs else None
            return GeneratedSample(ep.response, lps, ep.finish_reason, ep.version, episode=ep)

        tasks = [asyncio.ensure_future(one(i)) for i in range(sampling.n)]
        try:
            samples = list(await asyncio.gather(*tasks))
        except EpisodeError as e:
            self.counters["failed_episodes"] += 1
            log.warning("prompt %d: agent episode failed: %s", prompt_id, e)
            raise AgentFailed(str(e)) from None
        finally:
            for t in tasks:
                t.cancel()
        self.counters["prompts"] += 1
        self.counters["samples"] += len(samples)
        self.counters["episodes"] += len(samples)
        self.counters["agent_turns"] += sum(s.episode.turns for s in samples)
        self.counters["agent_later_turn_tokens"] += sum(s.episode.later_turn_tokens for s in samples)
        self.counters["agent_later_turn_cached"] += sum(s.episode.later_turn_cached for s in samples)
        return PromptResult(prompt_id, list(token_ids), samples)

    def _action_text(self, token_ids: list[int]) -> str:
        """An action as the environment reads it: as vLLM's own detokenizer would give it
        (special tokens such as EOS left out)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _turn_params(self, sp: Any) -> Any:
        """vLLM parameters of one agent turn from what the executor passes (ours, or one its
        environment returned): the sampling choices kept; one sample, the sampled token's
        log-prob, the final output only. Not detokenized by vLLM: the environment's action text
        is decoded once per turn (``_action_text``); the episode is built from the token ids."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty,
            max_tokens=sp.max_tokens,
            min_tokens=sp.min_tokens,
            stop_token_ids=list(sp.stop_token_ids or []),
            seed=sp.seed,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _request(self, prompt_id: int, token_ids: list[int], params: Any, min_version: int) -> tuple[Any, int]:
        """One vLLM request, admitted through the version gate; its final output and the
        version it was admitted under."""
        from vllm import TokensPrompt

        req_id = f"p{prompt_id}-{next(self._ids)}"
        while True:
            await self._admit(min_version)
            # The add is sent to the engine under the admission lock, and a pause takes the same
            # lock before it is sent: vLLM sees every add either before a pause or after the
            # resume, never a request admitted under one version and prefilled under another.
            async with self._admission:
                if self._holds or self.version < max(min_version, self.version_floor):
                    continue  # the gate closed while we queued for the lock
                admitted, lora = self.version, self._lora
                prompt = TokensPrompt(prompt_token_ids=list(token_ids))
                if self.cfg.enable_prefix_caching:
                    prompt["cache_salt"] = f"rayless-v{admitted}"
                q = await self.engine.add_request(req_id, prompt, params, lora_request=lora)
                break
        self._in_flight[req_id] = prompt_id
        if lora is not None:
            self._lora_users[lora.lora_int_id] += 1
        try:
            while True:
                out = q.get_nowait() or await q.get()
                if out.finished:
                    break
        except (asyncio.CancelledError, GeneratorExit):
            await self.engine.abort(req_id)
            raise
        finally:
            q.close()
            self._in_flight.pop(req_id, None)
            if lora is not None:
                self._lora_users[lora.lora_int_id] -= 1
                if lora is not self._lora and not self._lora_users[lora.lora_int_id]:
                    task = asyncio.ensure_future(self._retire_loras())
                    self._retiring.add(task)  # held until done (the loop keeps only a weak reference)
                    task.add_done_callback(self._retiring.discard)
        if lora is not None:
            # Every token came from the adapter it was admitted with; vLLM's spans label the
            # base weights (an adapter push leaves them alone): the version is the admission's.
            for o in out.outputs:
                o.weight_versions = None
        return out, admitted

    def _weight_spans(self, o) -> list:
        """vLLM's per-token weight-version spans of output ``o`` (the first says which weights
        sampled token 0); a sample whose tokens span an update is counted."""
        spans = getattr(o, "weight_versions", None) or []
        if len({span.version for span in spans}) > 1:
            self.counters["samples_across_updates"] += 1
        return spans

    def _sample(self, o, admitted: int, want_logprobs: bool) -> GeneratedSample:
        toks = list(o.token_ids)
        lps = None
        if want_logprobs:
            # Not strict: a short (or missing) list is the error just below, which names vLLM.
            lps = [float(d[t].logprob) for t, d in zip(toks, o.logprobs or [], strict=False)]
            if len(lps) != len(toks):
                raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(toks)} tokens")
        spans = self._weight_spans(o)
        version = int(spans[0].version) if spans else admitted  # the weights that sampled token 0
        reason = o.finish_reason if o.finish_reason in FINISH_REASONS else "abort"
        return GeneratedSample(toks, lps, reason, version)

    async def stream(self, batch: P.PromptBatch) -> AsyncIterator[PromptResult]:
        """Results of a batch as each prompt finishes (continuous batching inside vLLM)."""
        seeds: Sequence[int | None] = batch.seeds or [None] * len(batch.prompt_ids)
        tasks = [
            asyncio.ensure_future(self.generate(pid, toks, batch.sampling, batch.policy_version, seed=seed))
            for pid, toks, seed in zip(batch.prompt_ids, batch.token_ids, seeds, strict=True)
        ]
        try:
            for fut in asyncio.as_completed(tasks):
                yield await fut
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ gate
    async def _hold(self, reason: str) -> None:
        async with self._admission:
            first = not self._holds
            self._holds.add(reason)
            if first:
                # "keep": in-flight requests stay in vLLM and continue on resume.
                await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def _release(self, reason: str) -> None:
        if reason not in self._holds:
            return
        self._holds.discard(reason)
        if not self._holds:
            await self.engine.resume_generation()
        async with self._changed:
            self._changed.notify_all()

    async def pause(self) -> None:
        await self._hold("pause")

    async def resume(self) -> None:
        await self._release("pause")

    def sleep_supported(self) -> bool:
        return bool(self.cfg.enable_sleep and _sleep_mode_available())

    def _check_sleep(self) -> None:
        if not self.sleep_supported():
            why = _NO_SLEEP_ON_CPU if not _sleep_mode_available() else "this server was started without --enable_sleep"
            raise NotSupported(f"sleep/wake not supported: {why}")

    async def sleep(self, level: int = 1) -> None:
        self._check_sleep()
        await self._hold("sleep")
        await self.engine.sleep(level, mode="abort")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self._check_sleep()
        if await self.engine.wake_up(tags):
            await self.engine.reset_prefix_cache()
            await self._release("sleep")

    # ------------------------------------------------------------------ weights
    async def init_weight_transfer(self, backend: str, init_info: dict[str, Any], timeout_s: float) -> int:
        """Joins the learner's group; returns how many ranks this server contributes.
        ``timeout_s``: how long the learner waits for us to join (it gives up after that)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if backend != self.backend:
            raise BadRequest(
                f"learner pushes weights over {backend!r}, this server was started with "
                f"--weight_transfer_backend {self.backend!r}"
            )
        epoch, t0 = self._weight_epoch, time.monotonic()
        async with self._update_lock:
            self._check_epoch(epoch, "WeightSyncInit")
            if self._update_open:
                raise BadRequest("a weight update is open; finish it before re-forming the group")
            left = timeout_s - (time.monotonic() - t0)
            if left < 1.0:
                # The learner has dropped this group's store by now: joining it would only hold
                # the worker (and the next WeightSyncInit) for the rendezvous timeout.
                raise TimeoutError(
                    f"waited {time.monotonic() - t0:.1f} s for the previous weight step to end; the learner gave "
                    f"up on this group after {timeout_s:.0f} s (it forms a new one when it asks again)"
                )
            if self.backend == "gloo":  # our receiver takes it (vLLM's own engines reject unknown fields)
                # The learner may ask for less (a fleet group: one server that never joins must
                # not hold every other one in the rendezvous for the whole push timeout).
                asked = init_info.get("rendezvous_timeout_s") or left
                init_info = {**init_info, "rendezvous_timeout_s": min(left, asked)}
            self._group_open = True
            # The group's own timeouts (in init_info) end a stuck rendezvous; this is a backstop.
            await asyncio.wait_for(
                self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)), timeout_s + 10
            )
        return self.workers

    async def close_weight_transfer(self) -> None:
        async with self._update_lock:
            self._group_open = False
            await self.engine.shutdown_weight_transfer_engine()

    def abort_weight_sync(self, why: str) -> Awaitable[None]:
        """The controller that drove the weight group is gone (``why``). Weight calls it queued
        are refused from now on (synchronously: call this before handing on any message of the
        next controller); the returned awaitable, once the update lock is free, fails the open
        update (if any) and shuts the group down."""
        self._weight_epoch += 1
        return self._drop_weight_sync(why)

    async def _drop_weight_sync(self, why: str) -> None:
        async with self._update_lock:
            if self._update_open:
                log.warning("aborting the open weight update: %s; serving nothing until a complete one lands", why)
                await self._fail_update()
            if self._group_open and self.llm is not None:
                self._group_open = False
                try:
                    await self.llm.shutdown_weight_transfer_engine()
                except Exception as e:  # noqa: BLE001 - the next WeightSyncInit replaces the group anyway
                    log.warning("could not shut down the weight group of the controller that went away: %r", e)

    def _check_epoch(self, epoch: int, what: str) -> None:
        if epoch != self._weight_epoch:
            raise BadRequest(f"{what} dropped: asked by a controller that has gone away since")

    async def start_weight_update(self, version: int, adapter_only: bool = False) -> None:
        epoch, t0 = self._weight_epoch, time.monotonic()
        async with self._update_lock:
            self._check_epoch(epoch, "WeightUpdateStart")
            if self._update_open:
                raise BadRequest(f"weight update to v{version}: an update is already open")
            self._pending_adapter = None
            if adapter_only:
                self._check_lora()
                if "update_failed" in self._holds:
                    raise BadRequest(
                        f"adapter-only update to v{version}: the weights are incomplete after a failed update; push them whole"
                    )
                self._update_open, self._update_adapter_only = True, True  # generation goes on
                return
            self._update_adapter_only = False
            t1 = time.monotonic()
            await self._hold("update")
            if time.monotonic() - t0 > 1.0:  # the learner's push waits for this: say where it went
                log.warning(
                    "weight update to v%d: %.2f s waiting for the previous weight step, %.2f s pausing generation",
                    version,
                    t1 - t0,
                    time.monotonic() - t1,
                )
            try:
                await self.engine.start_weight_update()
            except BaseException:
                await self._fail_update()
                raise
            self._update_open = True

    async def update_weights(
        self,
        names: list[str],
        dtype_names: list[str],
        shapes: list[list[int]],
        aliases: dict[str, str] | None = None,
        lora: P.LoraAdapter | None = None,
    ) -> float:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from rollout_service.weight_receiver import RECEIVERS

        epoch = self._weight_epoch
        async with self._update_lock:
            self._check_epoch(epoch, "WeightUpdate")
            if not self._update_open:
                raise BadRequest("WeightUpdate without WeightUpdateStart")
            info: dict = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
            if aliases:
                if self.backend not in RECEIVERS:  # vLLM's own receivers take no aliases
                    await self._fail_update()
                    raise BadRequest(f"WeightUpdate.aliases: the {self.backend} receiver cannot load them")
                info["aliases"] = aliases
            if lora is not None:
                return await self._receive_adapter(info, lora)
            if self._update_adapter_only:
                await self._fail_update()
                raise BadRequest("WeightUpdate of weights in an adapter-only update (WeightUpdateStart.adapter_only)")
            t0 = time.perf_counter()
            try:
                await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))
            except BaseException:
                await self._fail_update()
                raise
            return time.perf_counter() - t0

    async def finish_weight_update(self, version: int) -> bool:
        """Returns whether the prefix cache could be reset outright (False: kept requests still
        hold blocks; the version salt keeps them apart)."""
        epoch = self._weight_epoch
        async with self._update_lock:
            self._check_epoch(epoch, "WeightUpdateFinish")
            if not self._update_open:
                raise BadRequest("WeightUpdateFinish without WeightUpdateStart")
            try:
                if not self._update_adapter_only:
                    await self.engine.finish_weight_update(weight_version=str(version))
                lora = await self._load_adapter(version) if self._pending_adapter is not None else None
            except BaseException:
                await self._fail_update()
                raise
            self._update_open = False
            # An adapter-only update leaves the KV of the weights alone; vLLM keys cached blocks
            # by adapter, and the version salt keeps versions apart anyway.
            reset = False if self._update_adapter_only else await self.engine.reset_prefix_cache()
            if lora is not None or not self._update_adapter_only:
                self._lora = lora  # whole weights without an adapter: served alone
            self.version = version
            self.counters["updates"] += 1
            self._holds.discard("update_failed")
            await self._release("update")
            await self._retire_loras()
            served = f"adapter {lora.lora_name}" if lora is not None else "no adapter"
            log.info("weights now at policy version %d (%s; prefix cache reset: %s)", version, served, reset)
            return reset

    # ------------------------------------------------------------------ LoRA adapters
    def _check_lora(self) -> None:
        if not self.cfg.enable_lora:
            raise BadRequest(
                "a LoRA adapter pushed to a server started without --enable_lora (the learner's --lora_sync adapter "
                "needs it; --lora_sync merged does not)"
            )

    async def _receive_adapter(self, info: dict, lora: P.LoraAdapter) -> float:
        """The adapter's tensors over the weight group, written by the first worker as a PEFT
        folder; served from WeightUpdateFinish on. Called under the update lock."""
        try:
            self._check_lora()
            if lora.rank > self.cfg.max_lora_rank:
                raise BadRequest(
                    f"adapter of rank {lora.rank} over this server's --max_lora_rank {self.cfg.max_lora_rank}"
                )
        except BadRequest:
            await self._fail_update()
            raise
        assert self._lora_root is not None  # made by start() with --enable_lora
        lora_id = next(self._lora_ids)
        folder = self._lora_root / f"adapter-{lora_id}"
        t0 = time.perf_counter()
        try:
            whole = not self._update_adapter_only  # the base weights come first (a joiner)
            await self.engine.collective_rpc(
                "rayless_receive_adapter", args=(info, str(folder), msgspec.to_builtins(lora), whole)
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            await self._fail_update()
            raise
        self._pending_adapter = (lora_id, folder)
        return time.perf_counter() - t0

    async def _load_adapter(self, version: int) -> Any:
        from vllm.lora.request import LoRARequest

        assert self._pending_adapter is not None
        (lora_id, folder), self._pending_adapter = self._pending_adapter, None
        req = LoRARequest(f"rayless-v{version}-{lora_id}", lora_id, str(folder))
        try:
            if not await self.engine.add_lora(req):
                raise RuntimeError(f"vLLM did not load the adapter of v{version} from {folder}")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._loras[lora_id] = folder
        self.counters["adapters"] += 1
        return req

    async def _retire_loras(self) -> None:
        """Removes the adapters no request uses that are not the current one (engine and folder)."""
        current = self._lora.lora_int_id if self._lora is not None else None
        # Taken out before the first await: another call (a request ending meanwhile) sees them gone.
        done = [(i, self._loras.pop(i)) for i in list(self._loras) if i != current and not self._lora_users[i]]
        for i, folder in done:
            self._lora_users.pop(i, None)
            try:
                if self.llm is not None:
                    await self.llm.remove_lora(i)
            except Exception as e:  # noqa: BLE001 - an adapter left in the engine's cache is memory, not a wrong answer
                log.warning("could not remove adapter %d from the engine: %r", i, e)
            shutil.rmtree(folder, ignore_errors=True)

    async def _fail_update(self) -> None:
        """Weights may be half-loaded: serve nothing until a complete update lands. vLLM's worker
        ends its update session itself when a receive raises, but not when the update is
        abandoned between calls (the learner killed after WeightUpdateStart, a refused
        WeightUpdate): its session would stay open, refusing the next start ("a weight update
        is already active") and the group's shutdown. The worker extension ends it."""
        self._update_open = False
        self.counters["failed_updates"] += 1
        self._holds.add("update_failed")
        self._holds.discard("update")
        if self.llm is not None:
            try:
                await self.llm.collective_rpc("rayless_abandon_weight_update")
            except Exception as e:  # noqa: BLE001 - the next start names a worker still stuck
                log.warning("could not end the worker's abandoned weight update: %r", e)

    # ------------------------------------------------------------------ metrics
    @property
    def state(self) -> str:
        for reason, name in (
            ("update_failed", "update_failed"),
            ("sleep", "sleeping"),
            ("update", "updating"),
            ("pause", "paused"),
        ):
            if reason in self._holds:
                return name
        return "serving"

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def metrics(self) -> dict[str, float]:
        return {
            "in_flight": float(len(self._in_flight)),
            "waiting": float(self._waiting),
            "tokens_per_s": round(self._meter.rate(), 2),
            "generated_tokens": float(self._meter.total),
            "policy_version": float(self.version),
            **{k: float(v) for k, v in self.counters.items()},
        }
