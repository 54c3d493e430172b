"""train_ppo's prompt-data flags as OpenRLHF 0.10's ``prepare_datasets`` reads them:

* ``--data.max_samples`` N: the first N rows of each --prompt_data source, then the first N of
  their mix; of --eval_dataset, the first N of its sources one after another;
* ``--data.prompt_probs``: the sources interleaved by ``datasets.interleave_datasets`` with
  those probabilities, ``--train.seed`` and ``all_exhausted``; without it, concatenated;
* ``--data.prompt_split`` / ``--eval.split``: the split taken from a saved (or hub) dataset;
  a data file is all one split.
"""

from __future__ import annotations

import json

import pytest

from common.config import build
from learner.rl.config import PPOConfig
from learner.rl.prompts import load_prompt_items


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _jsonl(path, prefix: str, n: int):
    path.write_text("".join(json.dumps({"input": f"{prefix}{i}"}) + "\n" for i in range(n)))
    return str(path)


def _cfg(**kw) -> PPOConfig:
    base = dict(pretrain="m", prompt_data="p", advantage_estimator="group_norm", n_samples_per_prompt=2)
    return build(PPOConfig, **{**base, "rollout_batch_size": 4, "train_batch_size": 8, **kw})


def _texts(items) -> list[str]:
    return [it.text for it in items]


def test_max_samples_caps_each_source_then_the_mix(tmp_path, tokenizer):
    import datasets

    a, b = _jsonl(tmp_path / "a.jsonl", "a", 6), _jsonl(tmp_path / "b.jsonl", "b", 4)
    # Concatenated (no --prompt_data_probs): a0..a5 (6 <= 7), b0..b3, then the first 7 of the ten.
    got = _texts(load_prompt_items(_cfg(max_samples=7), tokenizer, f"{a},{b}"))
    assert got == [f"a{i}" for i in range(6)] + ["b0"]
    # Mixed: OpenRLHF interleaves the capped sources with the run's seed until all are used up,
    # then keeps the first N: the same call here gives the same order.
    mixed = _texts(load_prompt_items(_cfg(max_samples=5, prompt_data_probs="0.5,0.5", seed=3), tokenizer, f"{a},{b}"))
    parts = [
        datasets.Dataset.from_list([{"input": f"{p}{i}"} for i in range(min(n, 5))]) for p, n in (("a", 6), ("b", 4))
    ]
    want = datasets.interleave_datasets(parts, probabilities=[0.5, 0.5], seed=3, stopping_strategy="all_exhausted")
    assert mixed == want["input"][:5] and len(want) > 5  # the mix was longer: the total is capped too
    # Another seed, another mix (the flag is read).
    other = _texts(load_prompt_items(_cfg(max_samples=50, prompt_data_probs="0.5,0.5", seed=4), tokenizer, f"{a},{b}"))
    assert other != _texts(
        load_prompt_items(_cfg(max_samples=50, prompt_data_probs="0.5,0.5", seed=3), tokenizer, f"{a},{b}")
    )


def test_eval_prompts_are_the_first_max_samples_of_their_sources_in_order(tmp_path, tokenizer):
    a, b = _jsonl(tmp_path / "a.jsonl", "a", 6), _jsonl(tmp_path / "b.jsonl", "b", 4)
    cfg = _cfg(max_samples=8, prompt_data_probs="0.9,0.1")  # training's probabilities do not mix evaluation data
    got = load_prompt_items(cfg, tokenizer, f"{a},{b}", evaluation=True)
    assert _texts(got) == [f"a{i}" for i in range(6)] + ["b0", "b1"]
    assert [it.source for it in got] == ["a"] * 6 + ["b"] * 2  # each names its data source (the file)


def test_prompt_split_and_eval_split_pick_the_split_of_a_saved_dataset(tmp_path, tokenizer):
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"input": f"train{i}"} for i in range(3)]),
            "test": datasets.Dataset.from_list([{"input": f"test{i}"} for i in range(2)]),
        }
    ).save_to_disk(str(saved))
    assert _texts(load_prompt_items(_cfg(), tokenizer, str(saved))) == ["train0", "train1", "train2"]
    assert _texts(load_prompt_items(_cfg(prompt_split="test"), tokenizer, str(saved))) == ["test0", "test1"]
    # --eval_split is evaluation's alone, --prompt_split training's alone.
    split = _cfg(eval_split="test")
    assert _texts(load_prompt_items(split, tokenizer, str(saved), evaluation=True)) == ["test0", "test1"]
    assert _texts(load_prompt_items(split, tokenizer, str(saved))) == ["train0", "train1", "train2"]
    with pytest.raises(ValueError, match="no split 'validation'"):
        load_prompt_items(_cfg(prompt_split="validation"), tokenizer, str(saved))
    # A data file is its one split, whatever the flag says.
    assert _texts(load_prompt_items(_cfg(prompt_split="test"), tokenizer, _jsonl(tmp_path / "f.jsonl", "f", 2))) == [
        "f0",
        "f1",
    ]
