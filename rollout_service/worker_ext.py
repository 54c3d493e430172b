"""Code that runs inside vLLM's worker processes (named as vLLM's ``worker_extension_cls``).

vLLM imports this class in every worker before the model loads. Registering our
weight-transfer receivers on the way (``rollout_service.weight_receiver``) puts them where the
worker's ``load_model`` looks for the engine named by ``weight_transfer_config.backend``: this is
the one place registration can happen.
"""

from __future__ import annotations

from rollout_service.weight_receiver import register

register()


class RolloutWorkerExtension:
    """Methods vLLM mixes into its Worker class; callable through ``collective_rpc``."""

    def rayless_weight_transfer_engine(self) -> str:
        """The class name of this worker's weight-transfer engine ("" if none): lets the server
        check at start-up that the backend it asked for is the one that loaded."""
        engine = getattr(self, "weight_transfer_engine", None)
        return type(engine).__name__ if engine is not None else ""
