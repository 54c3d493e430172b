"""Code that runs inside vLLM's worker processes (named as vLLM's ``worker_extension_cls``).

vLLM imports this class in every worker before the model loads and before the worker creates
its message queues. Two things happen on the way:

* registering our weight-transfer receivers (``rollout_service.weight_receiver``) puts them
  where the worker's ``load_model`` looks for the engine named by
  ``weight_transfer_config.backend``: this is the one place registration can happen;
* ``common.vllm_spin.idle_spin_from_env``: the rollout server's ``--idle_spin_s`` (or a
  launcher's), passed in the environment (``IDLE_SPIN_ENV``).
"""

from __future__ import annotations

from common.vllm_spin import idle_spin_from_env, idle_spin_in_force
from rollout_service.weight_receiver import register

register()
idle_spin_from_env()


class RolloutWorkerExtension:
    """Methods vLLM mixes into its Worker class; callable through ``collective_rpc``."""

    def rayless_weight_transfer_engine(self) -> str:
        """The class name of this worker's weight-transfer engine ("" if none): lets the server
        check at start-up that the backend it asked for is the one that loaded."""
        engine = getattr(self, "weight_transfer_engine", None)
        return type(engine).__name__ if engine is not None else ""

    def rayless_idle_spin_s(self) -> float | None:
        """The idle spin this worker's queues were made with (None: a vLLM whose SpinCondition
        has another shape)."""
        return idle_spin_in_force()

    def rayless_abandon_weight_update(self) -> bool:
        """Ends a weight update session nobody will finish (``RolloutCore._fail_update``);
        returns whether one was open. Its layers stay half-loaded: the server serves nothing
        until a complete update lands, and the next ``start_weight_update`` re-initialises
        the layers this one left pending."""
        if not getattr(self, "_weight_update_active", False):
            return False
        self._weight_update_active = False
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.reset_weight_update_target()
        return True
