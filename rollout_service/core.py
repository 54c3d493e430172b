"""``RolloutCore``: one vLLM ``AsyncLLM`` turning prompt tokens into samples. No sockets.

The process wrapper (``rollout_service/server.py``) feeds it PromptBatches from the controller;
tests drive it in-process (``tests/helpers/fake_llm.py``: the same factory with a stand-in
engine). Token in, token out: prompts arrive as token ids and samples leave as token ids with the
log-prob vLLM sampled each token with (``logprobs_mode="processed_logprobs"``: after temperature
and top-k/top-p, which is what an importance-sampling correction must compare against), a finish
reason and the policy version of the weights that produced the first token.

The core is the admission gate and generation. What else a server does is an object of its own,
each owning its state: the weight pushes (``weight_session.WeightSession``: updates, the group,
the epoch), the LoRA adapters (``adapters.AdapterRegistry``) and agent episodes
(``episodes.EpisodeRunner``). They reach the gate only through its methods (``hold``,
``swap_hold``, ``serve_version``, ``turn``).

Built by ``await RolloutCore.create(cfg)``: the agent file is loaded first (a bad one fails in a
second, naming it), then vLLM's engine is started and probed; the core exists only with a running
engine (``shutdown`` stops it). ``create(cfg, engine=...)`` adopts an engine already built (the
tests' stand-in).

Admission and versions. A prompt is admitted (handed to vLLM) only when nothing holds the gate
(a pause, a weight update, sleep, a failed update) and the server's weights are at least the
version the controller asked for; until then it waits here, not in vLLM. The gate owns the
served version: the weight session moves it when an update finishes (``serve_version``), and a
request admitted under it is salted with it (``cache_salt="rayless-v{N}"``: a KV block computed
under one version is never a prefix hit for a request admitted under another) and carries the
adapter served then (``AdapterRegistry.acquire``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from common import protocol as P
from common.vllm_memory import EngineStartRefused, check_start, choose_share, start_refusal
from common.vllm_quiet import allow_engine_exit_time, shutdown_async_llm
from common.vllm_spin import IDLE_SPIN_ENV
from common.weights import resolve_backend
from rollout_service.adapters import AdapterRegistry
from rollout_service.config import RolloutConfig
from rollout_service.episodes import EPISODE_COUNTERS, EpisodeRunner
from rollout_service.errors import AgentFailed, BadRequest, NotSupported
from rollout_service.weight_session import WeightSession

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from rollout_service.agent import Episode

__all__ = ["AgentFailed", "BadRequest", "GeneratedSample", "NotSupported", "PromptResult", "RolloutCore"]

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
GPU_MEMORY_SHARE = 0.85  # --gpu_memory_utilization on a GPU when not given (CPU: common/vllm_memory.py)
MEMORY_FLAG = "--gpu_memory_utilization"


_NO_SLEEP_ON_CPU = "vLLM has no sleep mode on CPU (there is no device memory to free)"


def _sleep_mode_available() -> bool:
    """vLLM's sleep mode needs its CUDA memory allocator (vLLM refuses it on other platforms)."""
    import torch

    return torch.cuda.is_available()


@dataclass
class GeneratedSample:
    """One completion of a prompt as vLLM produced it, before any reward; or one agent episode
    (``episode`` set: its own prompt, action mask, reward, turns)."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "abort"
    policy_version: int  # version of the weights that sampled the first token (the first action's)
    episode: Episode | None = None  # of an agent sample


@dataclass
class PromptResult:
    prompt_id: int
    prompt_token_ids: list[int]
    samples: list[GeneratedSample]  # sampling.n of them, by sample index


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


# ---------------------------------------------------------------------------- the engine's start
def memory_share(cfg: RolloutConfig) -> float:
    """--gpu_memory_utilization, else this host's default (``common.vllm_memory``)."""
    if cfg.gpu_memory_utilization is not None:
        return cfg.gpu_memory_utilization
    return choose_share(None, GPU_MEMORY_SHARE, model=cfg.model, flag=MEMORY_FLAG, who=_who(cfg))


def _who(cfg: RolloutConfig) -> str:
    return cfg.name or "rollout server"


def engine_args(cfg: RolloutConfig, share: float | None = None):
    """vLLM's ``AsyncEngineArgs`` of this server (``share``: the memory share, else chosen)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    c = cfg
    backend = resolve_backend(c.weight_transfer_backend)
    kwargs: dict[str, Any] = dict(
        model=c.model,
        tensor_parallel_size=c.tensor_parallel_size,
        dtype=c.dtype,
        seed=c.seed,
        max_model_len=c.max_model_len,
        max_num_seqs=c.max_num_seqs,
        enforce_eager=c.enforce_eager,
        gpu_memory_utilization=memory_share(c) if share is None else share,
        enable_prefix_caching=c.enable_prefix_caching,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="rollout_service.worker_ext.RolloutWorkerExtension",
        weight_transfer_config={"backend": backend},
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
    if chunked is None and backend == "gloo":  # a CPU engine
        # vLLM 0.32 on CPU: a chunked prefill rewinds the request's generator, which a CPU
        # generator cannot do ("CPU Generator does not use offset"): the engine dies on the
        # first seeded prompt that gets chunked. Whole-prompt prefills avoid it.
        chunked = False
    if chunked is not None:
        kwargs["enable_chunked_prefill"] = chunked
    return AsyncEngineArgs(**kwargs)


def _start_engine(cfg: RolloutConfig, share: float) -> AsyncLLM:
    from vllm.v1.engine.async_llm import AsyncLLM

    if cfg.idle_spin_s is not None:  # read by rollout_service.worker_ext in the workers vLLM spawns
        os.environ[IDLE_SPIN_ENV] = str(cfg.idle_spin_s)
    allow_engine_exit_time()  # read by the EngineCore: its workers' time to exit (common/vllm_quiet.py)
    # vLLM-CPU's memory check, before any of its processes exist: a refusal is one line.
    check_start(share, model=cfg.model, flag=MEMORY_FLAG, who=_who(cfg))
    for attempt in range(1, cfg.engine_start_attempts + 1):
        try:
            return AsyncLLM.from_engine_args(engine_args(cfg, share))
        except RuntimeError as e:
            # vLLM 0.32's EngineCore asserts if its input thread is not ready within 10 s,
            # which happens on an overloaded host (seen on a busy 2-core CI box): retry.
            # Not when its worker refused for memory (that error is in its own process; the
            # check is read again here): the same start would be refused the same way.
            if "initialization failed" not in str(e):
                raise
            refused = start_refusal(share, model=cfg.model, flag=MEMORY_FLAG, who=_who(cfg))
            if refused is not None:
                raise EngineStartRefused(refused) from None
            if attempt == cfg.engine_start_attempts:
                raise
            log.warning(
                "vLLM engine failed to start (attempt %d of %d): %s; retrying", attempt, cfg.engine_start_attempts, e
            )
    raise AssertionError("unreachable: engine_start_attempts >= 1 is checked by RolloutConfig")


@dataclass
class EngineInfo:
    """What the started engine says about itself (announced in ``RolloutCapabilities``)."""

    workers: int  # vLLM worker processes = ranks in a weight group
    dtype: str
    idle_spin_s: float | None  # what the workers' queues spin
    memory_share: float | None


async def _pause_keep(engine: Any) -> None:
    """``engine.pause_generation(mode="keep", clear_cache=False)`` without its closing 20 ms
    sleep, which vLLM 0.32 says is "not required for correctness, just more intuitive ordering"
    (it lets outputs of requests that finished while pausing reach their callers first; in keep
    mode they are frozen, not finished). It was a third of a tiny model's push on a real server
    (docs/scale.md, Delta weight pushes: the fixed cost). An engine without that internal call
    (another vLLM, a stand-in) pauses the documented way."""
    pause = getattr(getattr(engine, "engine_core", None), "pause_scheduler_async", None)
    if pause is None:
        await engine.pause_generation(mode="keep", clear_cache=False)
    else:
        await pause(mode="keep", clear_cache=False)


class RolloutCore:
    def __init__(
        self,
        cfg: RolloutConfig,
        llm: AsyncLLM,
        info: EngineInfo,
        *,
        episodes: EpisodeRunner | None = None,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        """Use ``await RolloutCore.create(cfg)``: a core is built around a running engine."""
        self.cfg = cfg
        self.backend = resolve_backend(cfg.weight_transfer_backend)
        self.llm: AsyncLLM | None = llm  # None once shut down (see ``engine``)
        self.info = info
        # -- the gate (this object's; the weight session asks through hold/swap_hold/serve_version)
        self.version = 0  # the weights' version: what requests are admitted under
        # No prompt starts on weights older than this (the controller's version at Welcome).
        self.version_floor = 0
        self._holds: set[str] = set()  # reasons the gate is closed: pause, update, sleep, update_failed
        self._changed = asyncio.Condition()  # gate or version changed
        self._admission = asyncio.Lock()  # orders adds against pauses (see _request)
        # -- generation
        self._ids = itertools.count()
        self._in_flight: dict[str, int] = {}  # vLLM request id -> prompt id
        self._waiting = 0
        self._meter = _Meter()
        self.counters = {
            "prompts": 0,
            "samples": 0,
            "aborted": 0,
            "samples_across_updates": 0,  # kept in flight through an update: tokens of 2+ versions
            "aborted_by_controller": 0,  # prompts the controller dropped (P.Abort: too stale to train on)
        }
        # -- the parts
        self.adapters = adapters or AdapterRegistry.from_config(cfg, self._engine_or_none)
        self.weights = WeightSession(
            backend=self.backend, workers=info.workers, engine=self._engine_or_none, gate=self, adapters=self.adapters
        )
        self.episodes = episodes  # None: the server runs no agent

    @classmethod
    async def create(
        cls, cfg: RolloutConfig, *, engine: Any = None, episodes: EpisodeRunner | None = None
    ) -> RolloutCore:
        """A core serving ``cfg``'s model: loads the agent file (``--agent_func_path``; or takes
        ``episodes``), starts vLLM's engine (or adopts ``engine``), probes its workers. An engine
        started here is shut down again if the probe fails."""
        if episodes is None and cfg.agent_func_path:  # before the engine: a bad agent file fails in a second
            episodes = EpisodeRunner.load(
                cfg.agent_func_path, cfg.model, max_model_len=cfg.max_model_len, tool_call_parser=cfg.tool_call_parser
            )
        if episodes is not None and cfg.agent_env_workers:  # the environments in worker processes (env_pool.py)
            episodes = await episodes.in_workers(
                cfg.agent_func_path,
                cfg.model,
                workers=cfg.agent_env_workers,
                episode_timeout_s=cfg.agent_episode_timeout_s,
                memory_mb=cfg.agent_env_worker_memory_mb,
            )
        share = cfg.gpu_memory_utilization
        if engine is None:
            share = memory_share(cfg)
            engine = _start_engine(cfg, share)
        try:
            backend = resolve_backend(cfg.weight_transfer_backend)
            engines = await engine.collective_rpc("rayless_weight_transfer_engine")
            if not all(engines):
                raise RuntimeError(f"vLLM workers have no weight-transfer engine for backend {backend!r}: {engines}")
            info = EngineInfo(
                workers=len(engines),
                dtype=str(engine.model_config.dtype).removeprefix("torch."),
                idle_spin_s=(await engine.collective_rpc("rayless_idle_spin_s"))[0],
                memory_share=share,
            )
            core = cls(cfg, engine, info, episodes=episodes)
            await engine.update_weight_version(str(core.version))
        except BaseException:
            await shutdown_async_llm(engine)
            raise
        log.info(
            "engine up: %s, %d worker(s), dtype %s, weight transfer %s (%s), idle spin %s s",
            cfg.model,
            info.workers,
            info.dtype,
            core.backend,
            engines[0],
            info.idle_spin_s,
        )
        # vLLM keeps a traceback that reaches this frame (an exception it caught while the engine
        # started), and a finished frame keeps its locals: the engine must not be one of them, or
        # it outlives shutdown() and its __del__ fails at the interpreter's exit.
        engine = None
        return core

    def _engine_or_none(self) -> AsyncLLM | None:
        return self.llm

    @property
    def engine(self) -> AsyncLLM:
        """``llm``, for the code that runs before ``shutdown()``."""
        if self.llm is None:
            raise RuntimeError("the vLLM engine is not running (shut down)")
        return self.llm

    @property
    def agent_identity(self) -> str:
        return self.episodes.identity if self.episodes is not None else ""

    async def shutdown(self) -> None:
        if self.episodes is not None:
            await self.episodes.close()
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await shutdown_async_llm(llm)  # its output handler first: no EngineDeadError after a clean stop
        self.adapters.close()

    def capabilities(self) -> P.RolloutCapabilities:
        import torch

        return P.RolloutCapabilities(
            capacity=self.cfg.max_num_seqs,
            model=self.cfg.model,
            tp=self.cfg.tensor_parallel_size,
            workers=self.info.workers,
            dtype=self.info.dtype,
            weight_transfer_backend=self.backend,
            idle_spin_s=self.info.idle_spin_s,
            sleep=self.sleep_supported(),
            gpu_memory_utilization=self.info.memory_share,
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
        """``sampling.n`` episodes of this server's agent from one prompt (``EpisodeRunner``),
        every turn a request through this gate."""
        if self.episodes is None:
            raise BadRequest("agent episodes asked of a server that runs no agent (start it with --agent_func_path)")

        def first_params(i: int) -> Any:
            first = self._vllm_params(msgspec.structs.replace(sampling, n=1), prompt_id)
            # vLLM seeds sample i of a request with seed + i; each episode is requests of n=1.
            first.seed = None if params.seed is None else (params.seed + i) % P.SEED_LIMIT
            return first

        episodes = await self.episodes.run(
            prompt_id,
            token_ids,
            sampling.n,
            agent,
            label,
            first_params=first_params,
            turn=lambda toks, turn_params: self.turn(prompt_id, toks, turn_params, min_version),
            vocab=self.engine.model_config.get_vocab_size(),
        )
        samples = [
            GeneratedSample(
                e.response, e.logprobs if sampling.logprobs else None, e.finish_reason, e.version, episode=e
            )
            for e in episodes
        ]
        self.counters["prompts"] += 1
        self.counters["samples"] += len(samples)
        return PromptResult(prompt_id, list(token_ids), samples)

    async def turn(self, prompt_id: int, token_ids: list[int], params: Any, min_version: int) -> tuple[Any, int]:
        """One turn of an agent episode of prompt ``prompt_id``: a request of one sample through
        the gate, counted as generation; its final output and the version it was admitted under."""
        out, admitted = await self._request(prompt_id, token_ids, params, min_version)
        o = out.outputs[0]
        self._weight_spans(o)
        self._meter.add(len(o.token_ids))
        return out, admitted

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
                admitted, lora = self.version, self.adapters.acquire()
                prompt = TokensPrompt(prompt_token_ids=list(token_ids))
                if self.cfg.enable_prefix_caching:
                    prompt["cache_salt"] = f"rayless-v{admitted}"
                q = await self.engine.add_request(req_id, prompt, params, lora_request=lora)
                break
        self._in_flight[req_id] = prompt_id
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
            self.adapters.release(lora)
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
    async def hold(self, reason: str) -> None:
        """Closes the gate for ``reason``; the first hold pauses the engine (mode "keep":
        in-flight requests stay in vLLM and continue on resume)."""
        async with self._admission:
            first = not self._holds
            self._holds.add(reason)
            if first:
                await _pause_keep(self.engine)

    async def release(self, reason: str) -> None:
        """Drops hold ``reason``; the last one resumes the engine and wakes the waiting prompts."""
        if reason not in self._holds:
            return
        self._holds.discard(reason)
        if not self._holds:
            await self.engine.resume_generation()
        async with self._changed:
            self._changed.notify_all()

    def swap_hold(self, old: str, new: str) -> None:
        """The gate stays closed for ``new`` instead of ``old`` (held or not); the engine is not
        resumed (a failed update: nothing is served until a whole one lands)."""
        self._holds.add(new)
        self._holds.discard(old)

    async def serve_version(self, version: int) -> None:
        """The weights are now ``version`` (an update finished): requests are admitted under it,
        the update's holds are released and waiting prompts re-check their minimum version."""
        self.version = version
        self._holds.discard("update_failed")
        await self.release("update")
        async with self._changed:  # an adapter-only update held nothing, yet the version moved
            self._changed.notify_all()

    def admit_from(self, version: int) -> None:
        """No prompt starts on weights older than ``version`` from now on (a controller's version
        at its Welcome: its pushes bring at least that)."""
        self.version_floor = version

    def count_aborted_by_controller(self, prompts: int) -> None:
        """The server cancelled ``prompts`` prompts the controller dropped (``P.Abort``)."""
        self.counters["aborted_by_controller"] += prompts

    async def pause(self) -> None:
        await self.hold("pause")

    async def resume(self) -> None:
        await self.release("pause")

    def sleep_supported(self) -> bool:
        return bool(self.cfg.enable_sleep and _sleep_mode_available())

    def _check_sleep(self) -> None:
        if not self.sleep_supported():
            why = _NO_SLEEP_ON_CPU if not _sleep_mode_available() else "this server was started without --enable_sleep"
            raise NotSupported(f"sleep/wake not supported: {why}")

    async def sleep(self, level: int = 1) -> None:
        self._check_sleep()
        await self.hold("sleep")
        await self.engine.sleep(level, mode="abort")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self._check_sleep()
        if await self.engine.wake_up(tags):
            await self.engine.reset_prefix_cache()
            await self.release("sleep")

    # ------------------------------------------------------------------ weights (the session's)
    async def init_weight_transfer(self, backend: str, init_info: dict[str, Any], timeout_s: float) -> int:
        return await self.weights.init(backend, init_info, timeout_s)

    async def close_weight_transfer(self) -> None:
        await self.weights.close()

    def abort_weight_sync(self, why: str) -> Awaitable[None]:
        return self.weights.abort(why)

    async def start_weight_update(self, version: int, adapter_only: bool = False) -> None:
        await self.weights.start(version, adapter_only)

    async def update_weights(
        self,
        names: list[str],
        dtype_names: list[str],
        shapes: list[list[int]],
        aliases: dict[str, str] | None = None,
        lora: P.LoraAdapter | None = None,
        encoding: str = "",
    ) -> float:
        return await self.weights.update(names, dtype_names, shapes, aliases, lora, encoding)

    async def finish_weight_update(self, version: int) -> bool:
        return await self.weights.finish(version)

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
        """The heartbeat's stats: the core's counters and those of its parts, by the same names."""
        counters: dict[str, float] = {**self.counters, **self.weights.counters, **self.adapters.counters}
        # A server without an agent reports the episode counters too (zeros): one set of names.
        counters.update(self.episodes.metrics() if self.episodes is not None else dict.fromkeys(EPISODE_COUNTERS, 0))
        return {
            "in_flight": float(len(self._in_flight)),
            "waiting": float(self._waiting),
            "tokens_per_s": round(self._meter.rate(), 2),
            "generated_tokens": float(self._meter.total),
            "policy_version": float(self.version),
            # what it can serve now: its Hello's capacity, scaled by the share of its environment
            # workers that are up (env_pool.py; none up: 0, and the controller sends it nothing)
            "capacity": float(int(self.cfg.max_num_seqs * counters.get("env_capacity_share", 1.0))),
            **{k: float(v) for k, v in counters.items()},
        }
