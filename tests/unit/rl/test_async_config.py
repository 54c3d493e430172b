"""--async_train's flags: the IS correction it defaults, and contradictions refused by name."""

from __future__ import annotations

import pytest

from common.config import build, parse
from learner.rl.config import PPOConfig

BASE = ["--pretrain", "m", "--prompt_data", "p", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2"]
BASE += ["--train_batch_size", "8", "--micro_train_batch_size", "2"]


def cfg(*args: str) -> PPOConfig:
    return parse(PPOConfig, [*BASE, *args])


def test_lockstep_keeps_its_defaults():
    c = cfg()
    assert not c.train.async_enable and c.train.max_staleness == 1 and c.algo.advantage.is_correction == ""
    assert cfg("--is_correction", "none").algo.advantage.is_correction == ""
    assert (
        cfg("--is_correction", "icepop", "--is_correction_low_high", "0.5", "2").algo.advantage.is_correction
        == "icepop"
    )


def test_async_defaults_to_tis_and_takes_an_explicit_choice():
    c = cfg("--async_train")
    assert c.train.async_enable and c.train.max_staleness == 1 and c.algo.advantage.is_correction == "tis"
    assert cfg("--async_train", "--max_staleness", "0").train.max_staleness == 0
    assert cfg("--async_train", "--is_correction", "seq_mask_tis").algo.advantage.is_correction == "seq_mask_tis"
    # Off only when asked for by name.
    assert cfg("--async_train", "--is_correction", "none").algo.advantage.is_correction == ""


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(async_train=True, is_correction=""), "pass --is_correction none"),
        (dict(async_train=True, max_staleness=-1), "--max_staleness must be >= 0"),
        (dict(max_staleness=2), "--max_staleness bounds .* needs --async_train"),
    ],
)
def test_contradictions_are_refused_naming_the_flag(kw, needle):
    base = dict(pretrain="m", prompt_data="p", rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8)
    with pytest.raises(ValueError, match=needle):
        build(PPOConfig, **base, micro_train_batch_size=2, **kw)
    with pytest.raises(SystemExit):  # and on the command line, a usage error
        cfg(*[f"--{k}" if v is True else f"--{k}={v}" for k, v in kw.items()])
