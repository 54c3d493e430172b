"""``WeightSession``: a rollout server's side of the learner's weight pushes.

One push is WeightSyncInit (once per group), then WeightUpdateStart / WeightUpdate... /
WeightUpdateFinish; the session runs each step in order (one at a time, under its lock), drives
vLLM's weight-transfer calls, and owns what a push leaves behind: whether an update is open,
whether a group is formed, whether the weights are complete, the weight epoch. It does not own
the admission gate: it asks the core to close it (``Gate.hold``), to keep it closed after a
failure (``Gate.swap_hold``) and to serve a new version (``Gate.serve_version``). Adapters are the
registry's (``adapters.py``): the session tells it when to receive, load and serve one.

Versions. vLLM labels every output token with the weight version that sampled it
(``finish_weight_update(weight_version)``), and a sample's ``policy_version`` is the label of its
first token. Requests in flight when an update starts are kept (vLLM pause mode "keep") and
continue on the new weights afterwards; their version says they started on the old ones.

A controller lost mid-push. A learner killed between WeightUpdateStart and WeightUpdateFinish
leaves an update open that nobody will finish, and a group whose other end is gone. When the
server finds its controller gone, or a new controller welcomes it, ``abort`` marks the open
update failed (the weights may be half-loaded: nothing is served until a complete update lands,
which the new controller pushes before any prompt), drops the group, and bumps the weight epoch:
a weight call of the old controller still queued behind the update lock is refused when its turn
comes instead of running against a learner that is gone. A receive that was already running
cannot be interrupted (it is a collective inside vLLM's worker), but it does not need to be: gloo
raises "Connection closed by peer" within milliseconds of the learner's death. What did hang was
the rendezvous: a worker that tries to join a store nobody listens on any more (the learner died,
or gave up on us and dropped its store) retries the connect until its timeout, about three times
over, holding the worker and the update lock while the restarted learner's own WeightSyncInit
waits behind it and times out in turn. So a WeightSyncInit runs only within the learner's own
deadline: the worker is given what is left of ``timeout_s`` after the call waited for the lock,
and one that waited it all out is answered with an error at once (the learner has given up on
that group; it asks again).

Stale KV. After every update the prefix cache is reset. vLLM refuses that reset while kept
requests still hold KV blocks, so the core also salts prompts with the version
(``cache_salt="rayless-v{N}"``): a block computed under one version can never be a prefix hit for
a request admitted under another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from common import protocol as P
from rollout_service.adapters import AdapterRegistry
from rollout_service.errors import BadRequest

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


class Gate(Protocol):
    """What the session may ask of the admission gate (``RolloutCore`` is one)."""

    async def hold(self, reason: str) -> None:
        """Close the gate for ``reason`` (the engine pauses, in-flight requests kept)."""

    def swap_hold(self, old: str, new: str) -> None:
        """The gate stays closed for ``new`` instead of ``old`` (held or not), without resuming."""

    async def serve_version(self, version: int) -> None:
        """The weights are now ``version``: admit under it, release the update's holds."""


class WeightSession:
    def __init__(
        self,
        *,
        backend: str,
        workers: int,
        engine: Callable[[], AsyncLLM | None],
        gate: Gate,
        adapters: AdapterRegistry,
    ) -> None:
        """``workers``: ranks this server brings to a weight group (vLLM's workers); ``engine``:
        the core's engine (None once it is shut down)."""
        self.backend, self.workers = backend, workers
        self._engine, self._gate, self._adapters = engine, gate, adapters
        self._lock = asyncio.Lock()  # one weight-update step at a time
        self._open = False  # WeightUpdateStart seen, neither finished nor failed
        self._adapter_only = False  # the open update brings only an adapter
        self._group_open = False  # a weight group was formed and not yet shut down
        self._epoch = 0  # bumped by abort: older weight calls are refused
        self.incomplete = False  # an update failed: the weights may be half-loaded until a whole one lands
        self.counters = {"updates": 0, "failed_updates": 0}
        # Where the last push's time went on this server, in ms (logged at finish): what a push
        # costs beyond its bytes is mostly here (docs/scale.md, Delta pushes: the fixed cost).
        self.timings: dict[str, float] = {}

    @property
    def engine(self) -> AsyncLLM:
        llm = self._engine()
        if llm is None:
            raise RuntimeError("the vLLM engine is shut down")
        return llm

    # ------------------------------------------------------------------ the group
    async def init(self, backend: str, init_info: dict[str, Any], timeout_s: float) -> int:
        """Joins the learner's group; returns how many ranks this server contributes.
        ``timeout_s``: how long the learner waits for us to join (it gives up after that)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if backend != self.backend:
            raise BadRequest(
                f"learner pushes weights over {backend!r}, this server was started with "
                f"--weight_transfer_backend {self.backend!r}"
            )
        epoch, t0 = self._epoch, time.monotonic()
        async with self._lock:
            self._check_epoch(epoch, "WeightSyncInit")
            if self._open:
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

    async def close(self) -> None:
        async with self._lock:
            self._group_open = False
            await self.engine.shutdown_weight_transfer_engine()

    def abort(self, why: str) -> Awaitable[None]:
        """The controller that drove the weight group is gone (``why``). Weight calls it queued
        are refused from now on (synchronously: call this before handing on any message of the
        next controller); the returned awaitable, once the update lock is free, fails the open
        update (if any) and shuts the group down."""
        self._epoch += 1
        return self._drop(why)

    async def _drop(self, why: str) -> None:
        async with self._lock:
            if self._open:
                log.warning("aborting the open weight update: %s; serving nothing until a complete one lands", why)
                await self._fail()
            llm = self._engine()
            if self._group_open and llm is not None:
                self._group_open = False
                try:
                    await llm.shutdown_weight_transfer_engine()
                except Exception as e:  # noqa: BLE001 - the next WeightSyncInit replaces the group anyway
                    log.warning("could not shut down the weight group of the controller that went away: %r", e)

    def _check_epoch(self, epoch: int, what: str) -> None:
        if epoch != self._epoch:
            raise BadRequest(f"{what} dropped: asked by a controller that has gone away since")

    # ------------------------------------------------------------------ one update
    async def start(self, version: int, adapter_only: bool = False) -> None:
        epoch, t0 = self._epoch, time.monotonic()
        async with self._lock:
            self._check_epoch(epoch, "WeightUpdateStart")
            if self._open:
                raise BadRequest(f"weight update to v{version}: an update is already open")
            self._adapters.drop_pending()
            if adapter_only:
                self._adapters.check_enabled()
                if self.incomplete:
                    raise BadRequest(
                        f"adapter-only update to v{version}: the weights are incomplete after a failed update; push them whole"
                    )
                self._open, self._adapter_only = True, True  # generation goes on
                return
            self._adapter_only = False
            t1 = time.monotonic()
            await self._gate.hold("update")
            t2 = time.monotonic()
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
                await self._fail()
                raise
            self._open = True
            self.timings = {
                "wait": (t1 - t0) * 1e3,
                "pause": (t2 - t1) * 1e3,
                "start_rpc": (time.monotonic() - t2) * 1e3,
            }

    async def update(
        self,
        names: list[str],
        dtype_names: list[str],
        shapes: list[list[int]],
        aliases: dict[str, str] | None = None,
        lora: P.LoraAdapter | None = None,
        encoding: str = "",
    ) -> float:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from rollout_service.weight_receiver import RECEIVERS

        epoch = self._epoch
        async with self._lock:
            self._check_epoch(epoch, "WeightUpdate")
            if not self._open:
                raise BadRequest("WeightUpdate without WeightUpdateStart")
            info: dict = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
            if aliases and not encoding:
                if self.backend not in RECEIVERS:  # vLLM's own receivers take no aliases
                    await self._fail()
                    raise BadRequest(f"WeightUpdate.aliases: the {self.backend} receiver cannot load them")
                info["aliases"] = aliases
            if lora is None and self._adapter_only:
                await self._fail()
                raise BadRequest("WeightUpdate of weights in an adapter-only update (WeightUpdateStart.adapter_only)")
            try:
                if lora is not None:  # the adapter's tensors, written as a folder (the base first if whole)
                    return await self._adapters.receive(info, lora, whole=not self._adapter_only)
                t0 = time.perf_counter()
                if encoding:  # --weight_sync delta: through the workers' base, digests checked
                    if aliases:
                        info["aliases"] = aliases  # the base loads them; the engine never sees them
                    await self.engine.collective_rpc("rayless_receive_encoded", args=(info, encoding))
                else:
                    await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))
                self.timings["update_rpc"] = (time.perf_counter() - t0) * 1e3
                return time.perf_counter() - t0
            except BaseException as e:
                if encoding:
                    log.error("%s weight push failed (serving nothing until a full push lands): %s", encoding, e)
                await self._fail()
                raise

    async def finish(self, version: int) -> bool:
        """Returns whether the prefix cache could be reset outright (False: kept requests still
        hold blocks; the version salt keeps them apart)."""
        epoch = self._epoch
        async with self._lock:
            self._check_epoch(epoch, "WeightUpdateFinish")
            if not self._open:
                raise BadRequest("WeightUpdateFinish without WeightUpdateStart")
            t0 = time.monotonic()
            try:
                if not self._adapter_only:
                    await self.engine.finish_weight_update(weight_version=str(version))
                t1 = time.monotonic()
                lora = await self._adapters.load_pending(version) if self._adapters.has_pending else None
            except BaseException:
                await self._fail()
                raise
            self._open = False
            # An adapter-only update leaves the KV of the weights alone; vLLM keys cached blocks
            # by adapter, and the version salt keeps versions apart anyway.
            t2 = time.monotonic()
            reset = False if self._adapter_only else await self.engine.reset_prefix_cache()
            t3 = time.monotonic()
            if lora is not None or not self._adapter_only:
                self._adapters.serve(lora)  # whole weights without an adapter: served alone
            self.incomplete = False
            self.counters["updates"] += 1
            await self._gate.serve_version(version)
            await self._adapters.retire()
            served = f"adapter {lora.lora_name}" if lora is not None else "no adapter"
            self.timings.update(
                finish_rpc=(t1 - t0) * 1e3,
                adapter=(t2 - t1) * 1e3,
                reset_prefix_cache=(t3 - t2) * 1e3,
                resume=(time.monotonic() - t3) * 1e3,
            )
            log.info(
                "weights now at policy version %d (%s; prefix cache reset: %s; ms: %s)",
                version,
                served,
                reset,
                ", ".join(f"{k} {v:.1f}" for k, v in self.timings.items()),
            )
            return reset

    async def _fail(self) -> None:
        """Weights may be half-loaded: serve nothing until a complete update lands. vLLM's worker
        ends its update session itself when a receive raises, but not when the update is
        abandoned between calls (the learner killed after WeightUpdateStart, a refused
        WeightUpdate): its session would stay open, refusing the next start ("a weight update
        is already active") and the group's shutdown. The worker extension ends it."""
        self._open = False
        self.incomplete = True
        self.counters["failed_updates"] += 1
        self._adapters.drop_pending()
        self._gate.swap_hold("update", "update_failed")
        llm = self._engine()
        if llm is not None:
            try:
                await llm.collective_rpc("rayless_abandon_weight_update")
            except Exception as e:  # noqa: BLE001 - the next start names a worker still stuck
                log.warning("could not end the worker's abandoned weight update: %r", e)
