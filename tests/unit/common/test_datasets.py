"""common.datasets: local sources of every kind, seeded mixing, row checks that name file,
row and key, prompt rendering (chat template / input template) and the RL prompt rows."""

from __future__ import annotations

import json

import pytest

from common.datasets import (
    DataError,
    SkipCounter,
    end_with_eos,
    load_mixed,
    load_prompts,
    load_source,
    parse_probs,
    render_prompt,
    render_response,
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_every_local_source_kind_loads(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # never reach for the network

    rows = [{"input": f"q{i}", "label": str(i)} for i in range(5)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:3]), "test": datasets.Dataset.from_list(rows[3:])}
    ).save_to_disk(str(tmp_path / "saved"))
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "part1.jsonl", rows[:2])
    write_jsonl(folder / "part2.jsonl", rows[2:])

    for source in (jsonl, tmp_path / "b.json", tmp_path / "c.parquet", folder):
        ds = load_source(str(source))
        assert sorted(ds["input"]) == [r["input"] for r in rows], source
    assert load_source(str(tmp_path / "saved"), split="test")["input"] == ["q3", "q4"]
    with pytest.raises(DataError, match="no split 'validation'"):
        load_source(str(tmp_path / "saved"), split="validation")
    with pytest.raises(DataError, match="no such file"):
        load_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="hub dataset"):  # offline here: the hub hop fails clearly
        load_source("no-such-org/no-such-dataset-xyz")


def test_mixing_is_seeded_and_follows_probs_and_max_samples_caps_each_source(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": f"a{i}"} for i in range(200)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"input": f"b{i}"} for i in range(50)])
    spec = f"{a},{b}"
    mixed = load_mixed(spec, probs="0.5,0.5", seed=3, required_keys=["input"])
    again = load_mixed(spec, probs="0.5,0.5", seed=3, required_keys=["input"])
    assert mixed["input"] == again["input"]
    # all_exhausted: the smaller source is oversampled until the larger one is used up.
    n_a = sum(x.startswith("a") for x in mixed["input"])
    assert n_a == 200 and 150 < len(mixed) - n_a < 260
    assert set(mixed["_source"]) == {str(a), str(b)}

    cat = load_mixed(spec, max_samples=10, required_keys=["input"])  # no probs: concatenated
    assert cat["input"] == [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)]
    assert parse_probs("1.0", 1) is None and parse_probs("3,1", 2) == [0.75, 0.25]
    with pytest.raises(DataError, match="2 values for 3 datasets"):
        parse_probs("1,1", 3)


def test_bad_rows_error_names_file_row_and_key_or_are_skipped_with_a_count(tmp_path):
    path = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"chosen": "good", "rejected": "bad"},
            {"chosen": "good", "rejected": ""},  # row 1: empty response
            {"chosen": "good"},  # row 2: key missing
            {"chosen": "good", "rejected": "bad"},
        ],
    )
    with pytest.raises(DataError) as err:
        load_mixed(str(path), required_keys=["chosen", "rejected"])
    assert f"{path}, row 1, key 'rejected'" in str(err.value)

    skipped = SkipCounter()
    ds = load_mixed(str(path), required_keys=["chosen", "rejected"], skip_bad_rows=True, skipped=skipped)
    assert ds["_row"] == [0, 3] and skipped.total == 2
    assert "row 1" in skipped.report()
    with pytest.raises(DataError, match="no column 'prompt'"):
        load_mixed(str(path), required_keys=["prompt"])


def test_render_prompt_and_response_with_chat_template_and_input_template(tokenizer):
    chat = render_prompt("2+3?", tokenizer, apply_chat_template=True)
    assert chat == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("2+3?", input_template="Q: {}\nA:") == "Q: 2+3?\nA:"
    assert render_prompt("2+3?") == "2+3?"

    prompt, response = render_response("2+3?", "5", tokenizer, apply_chat_template=True)
    assert prompt == chat and response == "5<|im_end|>"  # ends where generation stops
    # Chat-format pair data: the whole conversation in the response column.
    conv = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    assert render_response(None, conv, tokenizer, apply_chat_template=True) == (prompt, response)
    assert render_response("2+3?", "5", tokenizer, input_template="Q: {}\nA: ") == ("Q: 2+3?\nA: ", "5<|im_end|>")
    assert end_with_eos("x<|im_end|>\n", "<|im_end|>") == "x<|im_end|>"
    with pytest.raises(DataError, match="apply_chat_template"):
        render_response(None, conv, tokenizer)


def test_prompt_rows_tokenize_as_rendered_and_over_long_prompts_raise_or_skip(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"question": "What is 2 + 3?", "answer": "5"},
            {"question": "What is 1 + 1? " * 30, "answer": "2"},  # row 1: too long
            {"question": "Reverse the string: abc.", "answer": "cba"},
        ],
    )
    with pytest.raises(DataError, match=rf"{path}, row 1, key 'question': prompt is \d+ tokens"):
        load_prompts(
            str(path), tokenizer, input_key="question", label_key="answer", apply_chat_template=True, prompt_max_len=40
        )
    rows, skipped = load_prompts(
        str(path),
        tokenizer,
        input_key="question",
        label_key="answer",
        apply_chat_template=True,
        prompt_max_len=40,
        skip_bad_rows=True,
    )
    assert [r.label for r in rows] == ["5", "cba"] and [r.row for r in rows] == [0, 2]
    assert skipped.counts["over --prompt_max_len"] == 1
    assert rows[0].prompt.startswith("<|im_start|>user\nWhat is 2 + 3?")
    assert rows[0].input_ids == tokenizer(rows[0].prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(rows[0].input_ids) == rows[0].prompt


def test_each_prompt_names_its_data_source_from_its_column_its_file_or_default(tmp_path, tokenizer):
    """OpenRLHF's per-row ``datasource``; without one, the file's name when several are mixed,
    else ``default``."""
    tagged = write_jsonl(
        tmp_path / "mixed.jsonl",
        [{"q": "1+1=", "datasource": "math"}, {"q": "abc", "datasource": "copy"}, {"q": "x", "datasource": None}],
    )
    rows, _ = load_prompts(str(tagged), tokenizer, input_key="q", datasource_key="datasource")
    assert [r.datasource for r in rows] == ["math", "copy", "default"]
    a = write_jsonl(tmp_path / "gsm.jsonl", [{"q": "2+2="}])
    b = write_jsonl(tmp_path / "aime.jsonl", [{"q": "3+3="}])
    rows, _ = load_prompts(f"{a},{b}", tokenizer, input_key="q", datasource_key="datasource")
    assert [r.datasource for r in rows] == ["gsm", "aime"]
    rows, _ = load_prompts(str(a), tokenizer, input_key="q", datasource_key="datasource")
    assert [r.datasource for r in rows] == ["default"]
