"""Code that runs inside vLLM's worker processes (named as vLLM's ``worker_extension_cls``).

vLLM imports this class in every worker before the model loads and before the worker creates
its message queues. Three things happen on the way:

* registering our weight-transfer receivers (``rollout_service.weight_receiver``) puts them
  where the worker's ``load_model`` looks for the engine named by
  ``weight_transfer_config.backend``: this is the one place registration can happen;
* ``common.vllm_spin.idle_spin_from_env``: the rollout server's ``--idle_spin_s`` (or a
  launcher's), passed in the environment (``IDLE_SPIN_ENV``);
* ``common.vllm_quiet.quiet_rotary_reload_warning``: the workers load the pushed weights, and
  vLLM warns there, for every push, that rotary embeddings (which have no weights) got none.

``rayless_receive_encoded`` takes a push of ``--weight_sync delta`` (``common.weights.delta``):
whole tensors kept as this worker's base, or the changes to it, checked by their digests before
anything is loaded.

``rayless_receive_adapter`` takes a LoRA adapter pushed over the weight group (``--lora_sync
adapter``) and writes it as the PEFT folder vLLM's ``add_lora`` loads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from common.vllm_quiet import quiet_rotary_reload_warning
from common.vllm_spin import idle_spin_from_env, idle_spin_in_force
from rollout_service.weight_receiver import register

log = logging.getLogger("vllm.rayless.worker_ext")

register()
idle_spin_from_env()
quiet_rotary_reload_warning()


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

    def rayless_receive_encoded(self, update_info: dict[str, Any], encoding: str) -> int:
        """Receives a ``full`` or ``delta`` push (``WeightUpdate.encoding``) through this worker's
        weight-transfer engine (any backend: its receive hands each bucket to
        ``model.load_weights``, pointed for the call at the base's sink), checks every tensor's
        digest against the learner's, then loads the whole base (tied names too) into the model,
        inside the update session vLLM opened. Any failure, a digest mismatch included, drops
        the base: only a full push is taken after it. Returns the tensor count loaded."""
        from common.weights.delta import DeltaBase

        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("no weight-transfer engine in this worker")
        base: DeltaBase | None = getattr(self, "_rayless_delta_base", None)
        if base is None:
            base = self._rayless_delta_base = DeltaBase(getattr(engine, "device", None) or "cpu")
        model = engine.model
        try:
            base.begin(encoding, update_info.get("aliases"))
            # The engine passes the wire tensors straight on (vLLM's own engines take no aliases).
            info = {k: v for k, v in update_info.items() if k != "aliases"}
            engine.model = base.sink()
            try:
                self.update_weights(info)  # type: ignore[attr-defined]  # vLLM's Worker method
            finally:
                engine.model = model
            pairs = base.end()
        except BaseException as e:
            base.drop()
            log.error("weight push (%s) failed, base dropped: %s", encoding, e)
            raise
        vllm_config = getattr(self, "vllm_config", None)
        ctx = contextlib.nullcontext()
        if vllm_config is not None:
            from vllm.config import set_current_vllm_config

            ctx = set_current_vllm_config(vllm_config)
        with ctx:
            model.load_weights(pairs)
        return len(pairs)

    def rayless_receive_adapter(
        self, update_info: dict[str, Any], folder: str, lora: dict[str, Any], whole: bool
    ) -> int:
        """Receives a push that carries a LoRA adapter (``WeightUpdate.lora``) through this
        worker's weight-transfer engine (any backend: its receive hands each bucket to
        ``model.load_weights``, pointed for the call at ``_AdapterTensors``): the adapter's
        tensors are kept, the others (``whole``: the base weights, sent first, inside the update
        session vLLM opened) go on into the model. The first worker writes the adapter to
        ``folder`` as a PEFT adapter. Returns the adapter's tensor count."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("no weight-transfer engine in this worker")
        sink = _AdapterTensors(engine.model)
        engine.model = sink
        try:
            if whole:
                # The worker's own path (its session checks and errors); a method of vLLM's Worker,
                # which this class is mixed into, so mypy cannot see it on the class.
                self.update_weights(update_info)  # type: ignore[attr-defined]
            else:  # no update session: nothing of the model is touched
                engine.receive_weights(engine.parse_update_info(update_info))
        finally:
            engine.model = sink.model
        want = {n for n in update_info["names"] if ".lora_" in n}
        if want - set(sink.tensors):
            raise RuntimeError(f"the push ended without {len(want - set(sink.tensors))} of the adapter's tensors")
        if getattr(self, "rank", 0) == 0:
            write_peft_adapter(Path(folder), sink.tensors, lora)
        return len(sink.tensors)


class _AdapterTensors:
    """Stands in for the model during a receive: keeps a CPU copy of each adapter tensor (the
    engine's receive buffers are reused for the next push), passes the rest to the model."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.tensors: dict[str, Any] = {}

    def load_weights(self, pairs) -> set[str]:
        rest = []
        for name, t in pairs:
            if ".lora_" in name:
                self.tensors[name] = t.detach().to("cpu", copy=True).contiguous()
            else:
                rest.append((name, t))
        return self.model.load_weights(rest) if rest else set()


def write_peft_adapter(folder: Path, tensors: dict[str, Any], lora: dict[str, Any]) -> None:
    """``tensors`` (PEFT's saved names) and ``lora`` (``protocol.LoraAdapter`` as a dict) as the
    folder ``PeftModel.from_pretrained`` and vLLM's ``add_lora`` read."""
    from safetensors.torch import save_file

    part = folder.with_name(folder.name + ".part")
    part.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(part / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "target_modules": list(lora["target_modules"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "lora_dropout": 0.0,
    }
    (part / "adapter_config.json").write_text(json.dumps(config, indent=1))
    os.replace(part, folder)
