"""``python -m learner.lora_combine --model_path BASE --lora_path ADAPTER --output_path OUT``:
a base model and a LoRA adapter merged into one plain Hugging Face model (OpenRLHF's
``lora_combiner``, same flags).

The adapter is peft's (``adapter_config.json`` + weights), as OpenRLHF's trainers and rayless's
(``--ds.lora.rank``; ``learner.runtime.lora`` writes it to ``<save_path>/adapter/``, and a
``--lora_path`` naming that checkpoint folder finds it there) save it. With ``--is_rm`` the base
loads as a ``*ForSequenceClassification`` with one output, the reward model's layout
(``learner.runtime.models``); its ``score`` head comes from the adapter (peft's
``modules_to_save``, which rayless's RM trainer uses) or else from the base checkpoint, and a
head found in neither is an error rather than a random head saved as if trained.

How it differs from OpenRLHF's:

- the merge is computed in fp32 whatever the output dtype (OpenRLHF merges in bf16, rounding
  ``W + B @ A`` there); the result is stored in ``--ds.param_dtype``, by default the dtype the base
  checkpoint records (OpenRLHF: bf16);
- the output is written to a folder beside ``--output_path`` and renamed into place, so a crash
  leaves no half-written model; an existing non-empty ``--output_path`` is refused, never mixed
  with the new files.

The tokenizer is the base model's, saved beside the merged weights when the base has one.
Imports nothing heavy before the flags parse: ``--help`` is instant.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.atomic_dir import commit_dir
from common.config import flag, parse, section

log = logging.getLogger("learner.lora_combine")


@dataclass
class DSSection:
    """The merged model's numerics (OpenRLHF's ``ds.*``)."""

    param_dtype: str = flag(
        "auto",
        "dtype of the saved model: auto (the base checkpoint's own), bf16, fp16 or fp32; the merge itself runs in fp32",
        choices=("auto", "bf16", "fp16", "fp32"),
        flat="bf16",
        flat_const="bf16",
    )


@dataclass
class LoraCombineConfig:
    model_path: str = flag("", "the base model: a HF directory or hub name", required=True)
    lora_path: str = flag(
        "", "the LoRA adapter (peft's folder), or a rayless checkpoint holding it in adapter/", required=True
    )
    output_path: str = flag("", "where the merged model goes (must not exist, or be empty)", required=True)
    is_rm: bool = flag(False, "a reward model: the base loads as a sequence classifier with one output")
    ds: DSSection = section(DSSection, "numerics")
    log_level: str = flag("INFO", "logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


class CombineError(ValueError):
    """The inputs cannot be combined (no adapter, an output in the way, no reward head)."""


def parse_config(argv: Sequence[str] | None = None) -> LoraCombineConfig:
    return parse(
        LoraCombineConfig,
        argv,
        description="Merge a LoRA adapter into its base model and save a plain HF model (OpenRLHF's "
        "lora_combiner). See docs/trainers.md.",
        prog="python -m learner.lora_combine",
    )


def adapter_dir(lora_path: str | Path) -> Path:
    """The folder holding ``adapter_config.json``: ``lora_path`` or its ``adapter/``."""
    from learner.runtime.lora import ADAPTER_DIR

    path = Path(lora_path)
    for candidate in (path, path / ADAPTER_DIR):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise CombineError(f"--lora_path {path}: no adapter_config.json there or in {ADAPTER_DIR}/ (a peft adapter?)")


def combine(
    model_path: str, lora_path: str | Path, output_path: str | Path, *, is_rm: bool = False, param_dtype: str = "auto"
) -> Path:
    """Merges the adapter at ``lora_path`` into ``model_path`` and saves the result at
    ``output_path`` (returned). Raises CombineError naming the input at fault."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = Path(output_path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CombineError(f"--output_path {out} exists and is not an empty folder: remove it or choose another")
    source = adapter_dir(lora_path)
    auto: Any = AutoModelForSequenceClassification if is_rm else AutoModelForCausalLM
    extra = {"num_labels": 1} if is_rm else {}
    log.info("loading the base model %s in fp32 (%s)", model_path, auto.__name__)
    try:
        base, info = auto.from_pretrained(model_path, dtype=torch.float32, output_loading_info=True, **extra)
    except (OSError, ValueError, RuntimeError) as e:
        raise CombineError(f"--model_path {model_path}: {type(e).__name__}: {e}") from None
    saved_dtype = _saved_dtype(base.config, param_dtype)
    log.info("loading the LoRA adapter %s", source)
    try:
        model = PeftModel.from_pretrained(base, str(source))
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # shapes of another base, a broken file
        raise CombineError(f"--lora_path {source} does not fit {model_path}: {type(e).__name__}: {e}") from None
    if is_rm:
        _check_head(model, info, model_path, source)
    log.info("merging in fp32, saving in %s to %s", saved_dtype, out)
    merged = model.merge_and_unload(safe_merge=True).to(saved_dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        _save_tokenizer(model_path, tmp)
        commit_dir(tmp, out)  # an empty folder already there is replaced
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _saved_dtype(config: Any, param_dtype: str):
    import torch

    named = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if param_dtype != "auto":
        return named[param_dtype]
    recorded = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    return recorded if isinstance(recorded, torch.dtype) and recorded.is_floating_point else torch.float32


def _check_head(model: Any, info: dict, model_path: str, source: Path) -> None:
    """Every weight the base checkpoint lacked (a causal LM has no ``score`` head) must come from
    the adapter's ``modules_to_save``, or the merged model would hold freshly drawn weights."""
    trained = set(model.peft_config[model.active_adapter].modules_to_save or ())
    fresh = [k for k in info.get("missing_keys", ()) if k.split(".")[0] not in trained]
    if fresh:
        raise CombineError(
            f"--is_rm: neither {model_path} nor the adapter {source} holds {', '.join(sorted(fresh))} (the base has "
            "no such head and the adapter's modules_to_save does not name it): the merged reward model would score "
            "with a random head"
        )


def _save_tokenizer(model_path: str, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:  # a base saved without one
        log.warning("no tokenizer saved: %s has none that loads (%s)", model_path, e)
        return
    tokenizer.save_pretrained(out)


def main(argv: Sequence[str] | None = None) -> int:
    from common.config import log_config

    cfg = parse_config(argv)
    logging.basicConfig(
        level=cfg.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s lora_combine %(name)s: %(message)s"
    )
    log_config(cfg, log)
    try:
        out = combine(cfg.model_path, cfg.lora_path, cfg.output_path, is_rm=cfg.is_rm, param_dtype=cfg.ds.param_dtype)
    except CombineError as e:
        log.error("%s", e)
        return 2
    log.info("merged model saved to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
