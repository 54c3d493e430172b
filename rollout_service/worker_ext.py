"""Code that runs inside vLLM's worker processes (named as vLLM's ``worker_extension_cls``).

vLLM imports this class in every worker before the model loads. Importing
``common.weight_transfer_gloo`` on the way registers the ``gloo`` weight-transfer backend in
that process, which is the one place registration can happen: the engine is created by the
worker's ``load_model`` from ``weight_transfer_config.backend``.
"""

from __future__ import annotations

import common.weight_transfer_gloo  # noqa: F401  (registers the gloo backend in this worker)


class RolloutWorkerExtension:
    """Methods vLLM mixes into its Worker class; callable through ``collective_rpc``."""

    def rayless_weight_transfer_engine(self) -> str:
        """The class name of this worker's weight-transfer engine ("" if none): lets the server
        check at start-up that the backend it asked for is the one that loaded."""
        engine = getattr(self, "weight_transfer_engine", None)
        return type(engine).__name__ if engine is not None else ""
