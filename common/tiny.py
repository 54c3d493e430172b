"""The tiny model every test and the CPU demo run on, built locally in a few seconds.

There is no hub access at run time (CI, laptops, air-gapped clusters), yet the tests must
exercise the same loading code a user hits with ``--pretrain Qwen/Qwen2.5-0.5B-Instruct``:
``AutoModelForCausalLM`` / ``AutoTokenizer``, ``vllm.LLM``, DeepSpeed with
``HfDeepSpeedConfig``. So instead of a mock we build a real, if minute, Qwen2 checkpoint:

- model: ``Qwen2ForCausalLM``, randomly initialised from ``seed``, fp32, tied embeddings
  (as in the small Qwen2/2.5 models), GQA, head_dim 32 (vLLM's CPU attention supports 32);
- tokenizer: byte-level BPE trained on a small built-in corpus of the demo's text
  (arithmetic questions, string reversal, a few English sentences), using *exactly* the
  pre-tokenizer pipeline transformers' ``Qwen2Tokenizer`` rebuilds at load time (NFC, the
  Qwen2 split regex, byte-level). Trained with anything else, the saved merges would be
  applied to differently split text after loading and ids would silently disagree with
  ``tokenizers.Tokenizer.from_file``. The regex splits every ``\\p{N}`` alone, so digits are
  one token each, which helps arithmetic;
- ChatML chat template with ``<|im_start|>`` / ``<|im_end|>``, as Qwen2.5-Instruct uses.

Building is deterministic and cached: a marker file records a hash of everything that
shapes the result, and a directory holding a matching build is returned untouched.

Run: ``python -m common.tiny OUT_DIR`` builds (if needed) and prints the path.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from common.atomic_dir import publish_dir

# Bump when the builder changes in a way that changes its output: stale caches rebuild.
BUILD_VERSION = 1
MARKER = ".rayless-tiny.json"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 in this order
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# Same string transformers' Qwen2Tokenizer compiles (transformers/models/qwen2/
# tokenization_qwen2.py); the parity test in tests/unit/common/test_tiny_model.py guards the copy.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TARGET_VOCAB = 768  # BPE trainer target; the real size (`vocab_size` in config) may be less

# Model shape. head_dim = hidden_size / num_attention_heads = 32.
MODEL_DIMS = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    # Wider than the usual 0.02 so a random model's greedy choice has clear margins:
    # vLLM and transformers run different kernels, and near-tied logits would flip argmax.
    initializer_range=0.1,
)

_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def corpus() -> list[str]:
    """The fixed text the tokenizer is trained on: the demo's prompts and answers."""
    rng = random.Random(1234)  # fixed: the corpus must not depend on the model seed
    words = (
        "apple banana cherry model token reward policy value learner rollout "
        "service python answer question reverse string number sum product "
        "difference hello world the quick brown fox jumps over lazy dog"
    ).split()
    lines = [
        "What is 2 + 3? Answer: 5",
        "Reverse the string: hello. Answer: olleh",
        "You are a helpful assistant.",
        "The quick brown fox jumps over the lazy dog.",
        "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!",
        "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789",
        "Punctuation: , . ; : ! ? ' \" ( ) [ ] { } < > / \\ | _ - + * = % # @ & ^ ~ `",
        "It's a test; we're sure they'll see what I'd do, and you've seen I'm right.",
        "Think step by step.\nFirst, add the numbers.\n\nThen give the final answer.",
        "    indented line\n\tTabbed line\n",
        # The chat template's role headers, so "user\n" is not three tokens.
        "system\nYou are a helpful assistant.\n",
        "user\nWhat is 7 * 8?\n",
        "assistant\nThe answer is 56.\n",
    ] * 3
    for _ in range(300):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        val = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"What is {a} {op} {b}? Answer: {val}")
        lines.append(f"{a}{op}{b}={val}")
    for _ in range(200):
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        lines.append(f"Reverse the string: {w}. Answer: {w[::-1]}")
        lines.append(f'reverse "{w}" -> "{w[::-1]}"')
    for _ in range(200):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))).capitalize() + ".")
    return lines


def _spec_hash(seed: int) -> str:
    from importlib.metadata import version

    spec = dict(
        build_version=BUILD_VERSION,
        seed=seed,
        dims=MODEL_DIMS,
        target_vocab=TARGET_VOCAB,
        special=SPECIAL_TOKENS,
        regex=QWEN2_SPLIT_REGEX,
        chat_template=CHAT_TEMPLATE,
        corpus=corpus(),
        # A different library version may initialise or serialise differently.
        versions=[version(p) for p in ("torch", "transformers", "tokenizers")],
    )
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _is_complete(out_dir: Path, digest: str) -> bool:
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("spec_hash") == digest and all((out_dir / f).is_file() for f in _REQUIRED_FILES)


def _train_tokenizer():
    """Byte-level BPE with Qwen2's exact pre-tokenizer pipeline (see module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: nothing is unknown
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _build_into(tmp: Path, seed: int, digest: str) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    raw = _train_tokenizer()
    state = json.loads(raw.to_str())["model"]
    # Built the way AutoTokenizer rebuilds it at load time, so what we save is what loads.
    hf_tok = Qwen2Tokenizer(
        vocab=state["vocab"],
        merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MODEL_DIMS["max_position_embeddings"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    ids = hf_tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID], ids

    config = Qwen2Config(
        vocab_size=len(hf_tok),  # exact: a padded vocab lets a random model emit ids no token has
        tie_word_embeddings=True,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        use_sliding_window=False,
        dtype="float32",
        **MODEL_DIMS,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    # As Qwen2.5-Instruct: stop on <|im_end|> or <|endoftext|>.
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        pad_token_id=ENDOFTEXT_ID,
        do_sample=False,
    )
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    (tmp / MARKER).write_text(
        json.dumps({"spec_hash": digest, "seed": seed, "build_version": BUILD_VERSION}, indent=1) + "\n"
    )


def build_tiny_model(out_dir: str | os.PathLike, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Build (or find already built) the tiny Qwen2 model and tokenizer in ``out_dir``.

    Returns the directory, loadable by ``from_pretrained``, ``vllm.LLM`` and DeepSpeed.
    A directory holding a complete build with the same seed and builder is returned as is;
    a non-empty directory holding anything else raises ``FileExistsError`` unless
    ``overwrite`` is set. Safe against concurrent builders of the same directory: each
    builds aside and renames into place, the loser of the race keeps the winner's build.
    """
    out_dir = Path(out_dir).absolute()
    digest = _spec_hash(seed)
    if not overwrite and _is_complete(out_dir, digest):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out_dir} is not empty and holds no matching tiny model; pass overwrite=True to replace it"
            )
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return publish_dir(out_dir, lambda tmp: _build_into(tmp, seed, digest), lambda: _is_complete(out_dir, digest))


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m common.tiny", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", help="directory to build the model in (reused when complete)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--overwrite", action="store_true", help="replace whatever out_dir holds")
    args = p.parse_args(argv)
    print(build_tiny_model(args.out_dir, seed=args.seed, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
