"""Code that runs inside the reference engine's vLLM workers (``--ref_backend vllm``), named as
vLLM's ``worker_extension_cls``: importing it, as every worker does before it makes its message
queues, shortens their idle spin to ``IDLE_SPIN_ENV``'s value (``--ref_idle_spin_s``, or a
launcher's for every service: ``common.vllm_spin``). Without it the reference engine spun a core
for vLLM's 1 s after each scoring, into the learner's training phase on shared CPU cores.
"""

from __future__ import annotations

from common.vllm_spin import idle_spin_from_env, idle_spin_in_force

idle_spin_from_env()


class RefWorkerExtension:
    """Methods vLLM mixes into the reference engine's Worker class (``collective_rpc``)."""

    def rayless_idle_spin_s(self) -> float | None:
        """The idle spin this worker's queues were made with (None: a vLLM whose SpinCondition
        has another shape)."""
        return idle_spin_in_force()
