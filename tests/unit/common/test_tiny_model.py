"""The tiny model (common/tiny.py) loads through transformers like a hub Qwen2 model."""

from __future__ import annotations

import pytest

from common import tiny

TEXTS = [
    "What is 123 + 456? Answer: 579",
    "12*34=408",
    "What is 7 - 9? Answer: -2",
    "Reverse the string: hello. Answer: olleh",
    "  two  spaces, trailing space ",
    "line one\nline two\n\n\tindented\r\nend\n",
    "It's what we'll see, isn't it?",
    "unseen: héllo wörld ✓ 你好 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_split_regex_matches_transformers():
    # The tokenizer is trained with our copy; transformers rebuilds with its own at load.
    from transformers.models.qwen2 import tokenization_qwen2

    assert tiny.QWEN2_SPLIT_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX


def test_autotokenizer_matches_raw_tokenizer_and_round_trips(tiny_model_dir, hf_tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text, add_special_tokens=False).ids, text
        assert hf_tokenizer.decode(ids) == text
        assert raw.decode(ids, skip_special_tokens=False) == text


def test_digits_are_one_token_each(hf_tokenizer):
    tokens = hf_tokenizer.convert_ids_to_tokens(hf_tokenizer.encode("9081726354", add_special_tokens=False))
    assert tokens == list("9081726354")


def test_special_tokens_and_chat_template(tiny_model_dir, hf_tokenizer):
    assert len(hf_tokenizer) <= tiny.TARGET_VOCAB
    assert hf_tokenizer.convert_tokens_to_ids(list(tiny.SPECIAL_TOKENS)) == [
        tiny.ENDOFTEXT_ID,
        tiny.IM_START_ID,
        tiny.IM_END_ID,
    ]
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (tiny.IM_END_ID, tiny.ENDOFTEXT_ID)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tiny.IM_START_ID and ids.count(tiny.IM_END_ID) == 2


def test_config_ties_embeddings(tiny_model_dir, hf_tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.vocab_size == len(hf_tokenizer)
    assert config.hidden_size // config.num_attention_heads == 32  # a head size vLLM CPU supports
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 2, 0)
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    assert gen.eos_token_id == [tiny.IM_END_ID, tiny.ENDOFTEXT_ID]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_transformers_generates_deterministically(tiny_model_dir, hf_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = hf_tokenizer("What is 12 + 30? Answer:", return_tensors="pt")
    outs = []
    for _ in range(2):  # two independent loads: the weights on disk fix the output
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=hf_tokenizer.pad_token_id)
        outs.append(out[0, prompt.input_ids.shape[1] :].tolist())
    assert outs[0] == outs[1]
    assert len(outs[0]) >= 1


def test_build_is_deterministic_and_cached(tmp_path, tiny_model_dir):
    again = tiny.build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name

    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert tiny.build_tiny_model(again) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp  # cache hit: untouched

    other = tiny.build_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    with pytest.raises(FileExistsError):
        tiny.build_tiny_model(other, seed=0)  # holds a different build
    assert tiny.build_tiny_model(other, seed=0, overwrite=True) == other
    assert (other / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


def test_entry_point_prints_path(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "common.tiny", str(tmp_path / "m")], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip().splitlines()[-1] == str(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
