"""In-process stand-ins for rollout servers, for weight-sync tests without a vLLM engine.

``FakeServer`` answers the weight-sync control messages the way a real server does, with the
real worker-side receive loop (``GlooWeightTransferEngine``, as inside vLLM's workers) loading
into a model that records what ``load_weights`` got, and a LoRA adapter received by the real
worker-extension method into a PEFT folder per push (``adapters``). ``FakeControl`` is the publisher's control
channel to a set of them.
"""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import msgspec
import torch

from common import protocol as P
from common.transport import CallTimeout, RemoteError


class TinyLM(torch.nn.Module):
    """Tied embeddings and two 'layers', like the tiny Qwen2 but with no dependencies: the
    model a publisher sends from in the tests without vLLM."""

    def __init__(self, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


class _Reply:
    def __init__(self, fut: Future, server: str, what: str) -> None:
        self.fut, self.server, self.what = fut, server, what

    def result(self, timeout: float) -> P.Message:
        try:
            reply = self.fut.result(timeout)
        except TimeoutError:
            raise CallTimeout(f"no reply from {self.server} to {self.what} within {timeout:.1f} s") from None
        if isinstance(reply, P.Error):
            raise RemoteError(self.server, reply)
        return reply


class RecordingModel:
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, t in weights:
            self.loaded[name] = t.clone()


class FakeServer:
    """One rollout server's worker, driven by the control messages a real server gets."""

    def __init__(self, name: str, behaviour: str = "ok") -> None:
        from rollout_service.weight_receiver_gloo import GlooWeightTransferEngine

        self.name, self.behaviour = name, behaviour
        self.model = RecordingModel()
        cfg = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0), model_config=None
        )
        self.engine = GlooWeightTransferEngine(None, cfg, torch.device("cpu"), self.model)
        self.version = 0
        self.starts: list[bool] = []  # WeightUpdateStart.adapter_only of each push
        self.adapters: list[Path] = []  # the PEFT folder each adapter was written to
        self._worker = _Worker(self.engine)
        self._lora_root = Path(tempfile.mkdtemp(prefix=f"fake-{name}-lora-"))

    def engine_worker_base(self):
        """The worker's ``DeltaBase`` (--weight_sync delta), None before its first such push."""
        return getattr(self._worker, "_rayless_delta_base", None)

    def handle(self, msg: P.Message) -> Future:
        fut: Future = Future()

        def run():
            try:
                fut.set_result(self._handle(msg))
            except Exception as e:  # noqa: BLE001 - becomes the Error reply, as in the server
                fut.set_result(P.Error(code="internal", message=repr(e)))

        threading.Thread(target=run, daemon=True).start()
        return fut

    def _handle(self, msg):
        if isinstance(msg, P.WeightSyncInit):
            self.engine.init_transfer_engine(self.engine.parse_init_info(msg.init_info))
            return P.Ack(info=P.WorkersJoined(workers=1))
        if isinstance(msg, P.WeightUpdateStart):
            self.starts.append(msg.adapter_only)
            return P.Ack()
        if isinstance(msg, P.WeightUpdate):
            if self.behaviour == "stall":
                time.sleep(3600)  # alive, never receives: the sender must time out, not hang
            if self.behaviour == "die":
                self.engine.shutdown()  # gone mid-update: its end of the group closes
                raise RuntimeError("died")
            info = {"names": msg.names, "dtype_names": msg.dtype_names, "shapes": msg.shapes, "aliases": msg.aliases}
            if msg.lora is not None:  # as RolloutCore: the worker extension receives, one folder per push
                folder = self._lora_root / f"adapter-{len(self.adapters) + 1}"
                _Worker(self.engine).rayless_receive_adapter(
                    info, str(folder), msgspec.to_builtins(msg.lora), whole=not self.starts[-1]
                )
                self.adapters.append(folder)
            elif msg.encoding:  # as WeightSession: through the worker's base, digests checked
                self._worker.rayless_receive_encoded(info, msg.encoding)
            else:
                self.engine.update_weights(info)
            return P.Ack()
        if isinstance(msg, P.WeightUpdateFinish):
            self.version = msg.policy_version
            return P.Ack(info=P.UpdateFinished(policy_version=msg.policy_version, prefix_cache_reset=True))
        if isinstance(msg, P.WeightSyncClose):
            self.engine.shutdown()
            return P.Ack()
        raise ValueError(type(msg).__name__)


def _Worker(engine):
    """A vLLM worker as far as ``RolloutWorkerExtension`` reads one (its engine, rank 0)."""
    from rollout_service.worker_ext import RolloutWorkerExtension

    class Worker(RolloutWorkerExtension):
        def __init__(self) -> None:
            self.weight_transfer_engine, self.rank = engine, 0

        def update_weights(self, update_info):
            engine.update_weights(update_info)

    return Worker()


class FakeControl:
    def __init__(self, servers):
        self.servers = {s.name: s for s in servers}

    def request(self, server, msg):
        return _Reply(self.servers[server].handle(msg), server, type(msg).__name__)
