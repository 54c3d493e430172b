"""OpenRLHF 0.10's GPU-only model flags, built on the libraries made for them:

- ``--ds.use_liger_kernel``: Liger's Triton kernels (RMSNorm, rotary embedding, SwiGLU MLP) patched
  into each loaded model (``liger-kernel``, in the ``gpu`` extra);
- ``--ds.load_in_4bit``: QLoRA, the frozen base model in 4-bit NF4 with double quantization
  (``bitsandbytes``, in the ``gpu`` extra) under trained LoRA adapters; refused without
  ``--ds.lora.rank`` (``learner.runtime.flags.DSSection``);
- ``--ds.deepcompile``: DeepSpeed's DeepCompile (``{"compile": {"deepcompile": true}}`` in the
  trained engines' config, then ``engine.compile()``).

``gpu_plan`` is the whole decision: given the device and the flags it returns what the loaders
and ``make_engine`` add (``GpuPlan``), or, on a host without CUDA, nothing but one notice per
given flag saying why it cannot act there. ``learner.runtime.engine`` applies the plan
(``load_pretrained``, ``make_engine``) and says each notice once per process (``announce``).
Imports nothing heavy: a CPU test asks what it would do on ``cuda``.

Differences from OpenRLHF: Liger is patched into the loaded instance
(``_apply_liger_kernel_to_instance``, without the fused linear cross-entropy: our losses read the
logits, no labels reach the model's forward, so that kernel never acts; OpenRLHF's
``AutoLigerKernelForCausalLM`` patches it in and leaves it idle for the same reason), so the
reward model and the critic get the kernels too; 4-bit computes in the training dtype (OpenRLHF
asserts bf16) and skips OpenRLHF's per-module casts after the LoRA wrap, which DeepSpeed's own cast
of every floating parameter to the training dtype overrides anyway.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("rayless.gpu_features")

# flag -> (the module it imports on CUDA, the package that installs it)
_NEEDS = {
    "use_liger_kernel": ("liger_kernel", "liger-kernel"),
    "load_in_4bit": ("bitsandbytes", "bitsandbytes"),
}
# flag -> why it cannot act without CUDA ("{where}": the device; "{dtype}": the training dtype)
_WHY_NOT_HERE = {
    "use_liger_kernel": "Liger's kernels are Triton GPU kernels; this learner runs on {where}, so the model is "
    "loaded without them",
    "load_in_4bit": "QLoRA's 4-bit base saves GPU memory through bitsandbytes' CUDA kernels; this learner runs on "
    "{where}, so the base model loads in {dtype} and the LoRA adapters train on it unquantized",
    "deepcompile": "DeepCompile's compiler passes run only on CUDA (DeepSpeed's is_deepcompile_supported); this "
    "learner runs on {where}, so the engine runs eagerly",
}


@dataclass(frozen=True)
class GpuPlan:
    """What the GPU-only flags add to a model's loading and to its trained engine."""

    liger: bool = False  # patch Liger's kernels into the loaded model
    # BitsAndBytesConfig keywords (QLoRA's NF4 base), or None: load in the training dtype
    bnb_4bit: dict[str, Any] | None = None
    # merged into the trained engine's DeepSpeed config; "compile" means engine.compile() after it
    ds_config: dict[str, Any] = field(default_factory=dict)
    notices: tuple[str, ...] = ()  # one line per given flag that cannot act on this device

    @property
    def compile(self) -> bool:
        return bool(self.ds_config.get("compile", {}).get("deepcompile"))


def gpu_plan(
    device: Any,
    *,
    use_liger_kernel: bool = False,
    load_in_4bit: bool = False,
    deepcompile: bool = False,
    bf16: bool = False,
    zero_stage: int = 0,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
) -> GpuPlan:
    """The plan for ``device`` (``cuda``, ``cuda:1``, ``cpu`` ..., or a ``torch.device``).

    On CUDA a flag whose package is missing raises, naming the package and the extra: asked for
    on a GPU, a 4-bit run that silently loaded 16-bit weights would not fit where it was sized
    to. ``bf16`` and ``zero_stage`` are the model's (``--ds.param_dtype``, ``--ds.zero_stage``).
    """
    given = {"use_liger_kernel": use_liger_kernel, "load_in_4bit": load_in_4bit, "deepcompile": deepcompile}
    kind = str(device).split(":")[0]
    dtype = "bfloat16" if bf16 else "float32"
    if kind != "cuda":
        where = "CPU" if kind == "cpu" else kind
        why = {name: _WHY_NOT_HERE[name].format(where=where, dtype=dtype) for name, on in given.items() if on}
        return GpuPlan(notices=tuple(f"--ds.{name}: {line}" for name, line in why.items()))
    for name, (module, package) in _NEEDS.items():
        if given[name] and find_spec(module) is None:
            raise RuntimeError(
                f"--ds.{name} needs the {package} package on this GPU host: pip install -e '.[gpu]' "
                f"(or pip install {package})"
            )
    bnb = None
    if load_in_4bit:
        bnb = {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": dtype,
        }
        if zero_stage == 3:
            # ZeRO-3 partitions every parameter and casts floating ones to the training dtype:
            # packed 4-bit weights must be stored in that dtype to survive both (transformers'
            # and peft's recipe for QLoRA under ZeRO-3); uint8, bitsandbytes' default, otherwise.
            bnb["bnb_4bit_quant_storage"] = dtype
    return GpuPlan(
        liger=use_liger_kernel,
        bnb_4bit=bnb,
        ds_config={"compile": {"deepcompile": True}} if deepcompile else {},
    )


_said: set[str] = set()


def announce(plan: GpuPlan) -> None:
    """Logs each of ``plan``'s notices once per process: the actor, the critic and a reference
    model are loaded with the same flags, and one line per flag is what the user needs."""
    for notice in plan.notices:
        say_once(notice)


def say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        log.warning("%s", line)


def from_pretrained_kwargs(plan: GpuPlan) -> dict[str, Any]:
    """The keywords ``from_pretrained`` takes from the plan: the 4-bit quantization config.

    No ``device_map``: transformers places a 4-bit model on ``torch.cuda.current_device()``,
    which ``learner.runtime.engine.init_distributed`` set to this rank's GPU."""
    if plan.bnb_4bit is None:
        return {}
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(**plan.bnb_4bit)}


def apply_liger(model: Any) -> bool:
    """Patches Liger's kernels into ``model`` (a transformers model: causal LM or sequence
    classifier) in place; returns whether Liger has kernels for its type (else a warning, once).

    Liger also swaps the classes in transformers' modeling module for this architecture, so
    every model of it built later in the process gets them as well (Liger's own behaviour)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        say_once(f"--ds.use_liger_kernel: Liger has no kernels for model type {model_type}; loaded without them")
        return False
    # The fused linear cross-entropy would replace the model's forward (a sequence classifier's
    # with a causal LM's) and never act for us: no labels reach the forward.
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False)
    return True
