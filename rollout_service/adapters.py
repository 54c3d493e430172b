"""``AdapterRegistry``: the LoRA adapters a rollout server serves (``--enable_lora``).

A learner with ``--lora_sync adapter`` pushes only its adapter (``WeightUpdateStart.adapter_only``):
nothing pauses; the first worker writes the tensors as a PEFT folder (``receive``), and at
WeightUpdateFinish the engine loads it (``load_pending``, vLLM's ``add_lora``) and every request
admitted from then on carries it (``acquire``). A request keeps the adapter it was admitted with
to its last token, so its version is its admission's (vLLM's spans label the base weights, which
an adapter push leaves alone). An adapter no request uses any more, and that is not the current
one, is removed from the engine and its folder deleted (``retire``). A push of whole weights with
an adapter (a joiner, a restarted learner) loads the base, then serves the adapter; one without
(a learner pushing merged weights) serves the weights alone (``serve(None)``).

The registry owns the adapters (LoRA id -> folder), how many requests run with each, the one
received in the open update and the one served; the weight session (``weight_session.py``)
decides when an adapter is received, loaded and served, the core's admission takes one per
request and gives it back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from common import protocol as P
from rollout_service.config import RolloutConfig
from rollout_service.errors import BadRequest

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


class AdapterRegistry:
    def __init__(
        self, *, enabled: bool, max_lora_rank: int, root: Path | None, engine: Callable[[], AsyncLLM | None]
    ) -> None:
        """``root``: where adapters are written (None: a temporary folder of ours, made on first
        use and removed at ``close``); ``engine``: the core's engine (None once it is shut down)."""
        self.enabled, self.max_lora_rank = enabled, max_lora_rank
        self._engine = engine
        self._root_ours = root is None
        self._root = root
        self._loras: dict[int, Path] = {}  # registered with the engine: LoRA id -> folder
        self._users: Counter[int] = Counter()  # requests running with each
        self._ids = itertools.count(1)
        self._pending: tuple[int, Path] | None = None  # received in the open update: served from its finish
        self._current: LoRARequest | None = None  # what requests are admitted with (None: the weights alone)
        self._retiring: set[asyncio.Future] = set()
        self.counters = {"adapters": 0}  # LoRA adapters loaded

    @classmethod
    def from_config(cls, cfg: RolloutConfig, engine: Callable[[], AsyncLLM | None]) -> AdapterRegistry:
        root = None
        if cfg.enable_lora and cfg.lora_dir:
            root = Path(cfg.lora_dir)
            root.mkdir(parents=True, exist_ok=True)
        return cls(enabled=cfg.enable_lora, max_lora_rank=cfg.max_lora_rank, root=root, engine=engine)

    def check_enabled(self) -> None:
        if not self.enabled:
            raise BadRequest(
                "a LoRA adapter pushed to a server started without --enable_lora (the learner's --lora_sync adapter "
                "needs it; --lora_sync merged does not)"
            )

    def _folder(self, lora_id: int) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="rayless-lora-"))
        return self._root / f"adapter-{lora_id}"

    # ------------------------------------------------------------------ one update
    async def receive(self, info: dict, lora: P.LoraAdapter, *, whole: bool) -> float:
        """The adapter's tensors over the weight group, written by the first worker as a PEFT
        folder, held until ``load_pending``. ``whole``: the base weights come first (a joiner).
        Raises BadRequest for an adapter this server cannot serve; the caller fails the update."""
        self.check_enabled()
        if lora.rank > self.max_lora_rank:
            raise BadRequest(f"adapter of rank {lora.rank} over this server's --max_lora_rank {self.max_lora_rank}")
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the vLLM engine is shut down")
        lora_id = next(self._ids)
        folder = self._folder(lora_id)
        t0 = time.perf_counter()
        try:
            await engine.collective_rpc(
                "rayless_receive_adapter", args=(info, str(folder), msgspec.to_builtins(lora), whole)
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.drop_pending()  # a second adapter in one update replaces the first
        self._pending = (lora_id, folder)
        return time.perf_counter() - t0

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def drop_pending(self) -> None:
        """Forgets an adapter received in an update that did not finish (its folder removed)."""
        if self._pending is not None:
            shutil.rmtree(self._pending[1], ignore_errors=True)
            self._pending = None

    async def load_pending(self, version: int) -> LoRARequest:
        """Registers the adapter received in this update with the engine, as ``version``'s."""
        from vllm.lora.request import LoRARequest

        assert self._pending is not None, "load_pending without an adapter received"
        engine = self._engine()
        (lora_id, folder), self._pending = self._pending, None
        req = LoRARequest(f"rayless-v{version}-{lora_id}", lora_id, str(folder))
        try:
            if engine is None or not await engine.add_lora(req):
                raise RuntimeError(f"vLLM did not load the adapter of v{version} from {folder}")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._loras[lora_id] = folder
        self.counters["adapters"] += 1
        return req

    def serve(self, lora: LoRARequest | None) -> None:
        """Requests admitted from now on carry ``lora`` (None: the weights alone)."""
        self._current = lora

    @property
    def current(self) -> LoRARequest | None:
        return self._current

    # ------------------------------------------------------------------ requests
    def acquire(self) -> LoRARequest | None:
        """The adapter a request admitted now runs with (counted until ``release``)."""
        lora = self._current
        if lora is not None:
            self._users[lora.lora_int_id] += 1
        return lora

    def release(self, lora: LoRARequest | None) -> None:
        """A request admitted with ``lora`` ended; an old adapter it was the last user of is retired."""
        if lora is None:
            return
        self._users[lora.lora_int_id] -= 1
        if lora is not self._current and not self._users[lora.lora_int_id]:
            task = asyncio.ensure_future(self.retire())
            self._retiring.add(task)  # held until done (the loop keeps only a weak reference)
            task.add_done_callback(self._retiring.discard)

    async def retire(self) -> None:
        """Removes the adapters no request uses that are not the current one (engine and folder)."""
        current = self._current.lora_int_id if self._current is not None else None
        # Taken out before the first await: another call (a request ending meanwhile) sees them gone.
        done = [(i, self._loras.pop(i)) for i in list(self._loras) if i != current and not self._users[i]]
        for i, folder in done:
            self._users.pop(i, None)
            engine = self._engine()
            try:
                if engine is not None:
                    await engine.remove_lora(i)
            except Exception as e:  # noqa: BLE001 - an adapter left in the engine's cache is memory, not a wrong answer
                log.warning("could not remove adapter %d from the engine: %r", i, e)
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """At shutdown: every adapter folder, and the root when it is a temporary folder of ours."""
        self.drop_pending()
        for folder in self._loras.values():
            shutil.rmtree(folder, ignore_errors=True)
        if self._root is not None and self._root_ours:
            shutil.rmtree(self._root, ignore_errors=True)

    def folders(self) -> dict[int, Any]:
        """LoRA id -> folder of every adapter registered with the engine (tests, logs)."""
        return dict(self._loras)
