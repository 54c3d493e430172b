"""The workers' half of each weight-transfer backend, registered where vLLM looks for it.

vLLM builds each worker's weight-transfer engine by name from its ``WeightTransferEngineFactory``
(``weight_transfer_config.backend``, set by ``rollout_service/core.py``). vLLM ships ``nccl``
(and ``ipc``); ``RECEIVERS`` lists the engines we add for the backends it lacks. The learner's
halves are ``common.weights.base.SENDERS``; a backend name must have an entry on both sides.

Registration must happen inside vLLM's worker processes, before the model loads:
``rollout_service.worker_ext`` (vLLM's ``worker_extension_cls``, imported by every worker
before ``load_model``) calls ``register()``.
"""

from __future__ import annotations

# Backend name -> (module, class) of its vLLM WeightTransferEngine, imported when vLLM builds one.
RECEIVERS: dict[str, tuple[str, str]] = {
    "gloo": ("rollout_service.weight_receiver_gloo", "GlooWeightTransferEngine"),
}


def register() -> None:
    """Adds ``RECEIVERS`` to vLLM's worker-side registry (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, (module, cls) in RECEIVERS.items():
        try:
            WeightTransferEngineFactory.register_engine(name, module, cls)
        except ValueError:
            pass  # already registered in this process
