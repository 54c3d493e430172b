"""common.config's sections: both spellings of a flag, mixed; one flag given twice; flat names
shared by several flags or standing for a value; YAML in every form; inert flags said."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from common.config import ConfigError, build, build_parser, flag, flag_names, parse, section


@dataclass
class Adam:
    lr: float = flag(1e-6, "learning rate")
    betas: list[float] = flag([0.9, 0.95], "betas")


@dataclass
class Model:
    adam: Adam = section(Adam, "AdamW")
    max_norm: float = flag(1.0, "clip")
    dtype: str = flag("fp32", "dtype", choices=("fp32", "bf16"), flat="bf16", flat_const="bf16")


@dataclass
class KL:
    init_coef: float = flag(0.01, "KL coefficient", flat="init_kl_coef")
    use_loss: bool = flag(False, "KL as a loss", flat="use_kl_loss")


@dataclass
class Algo:
    kl: KL = section(KL, "KL")


@dataclass
class Cfg:
    actor: Model = section(Model, "the policy", flat={"adam.lr": "actor_learning_rate", "max_norm": "max_norm"})
    critic: Model = section(
        Model,
        "the critic",
        flat={"adam.lr": "critic_learning_rate", "max_norm": "max_norm"},
        defaults={"max_norm": 2.0},
    )
    algo: Algo = section(Algo, "the algorithm")
    zpg: int = flag(1, "ZeRO++", inert="not built here")
    notices: list[str] = field(default_factory=list, init=False)


def test_both_spellings_mix_in_one_command():
    c = parse(
        Cfg, ["--actor.adam.lr", "2e-6", "--critic_learning_rate", "3e-6", "--use_kl_loss", "--algo.kl.init_coef", "0"]
    )
    assert (c.actor.adam.lr, c.critic.adam.lr, c.algo.kl.use_loss, c.algo.kl.init_coef) == (2e-6, 3e-6, True, 0.0)


def test_a_section_keeps_the_defaults_of_where_it_is_embedded():
    c = parse(Cfg, [])
    assert (c.actor.max_norm, c.critic.max_norm) == (1.0, 2.0)


def test_one_flag_given_in_both_spellings_with_two_values_is_an_error_naming_both():
    with pytest.raises(ConfigError, match=r"--init_kl_coef 0.1 and --algo.kl.init_coef 0.2 set the same flag"):
        parse(Cfg, ["--init_kl_coef", "0.1", "--algo.kl.init_coef", "0.2"], raise_errors=True)
    # the same value twice is no contradiction; the same spelling twice: the last wins, as argparse
    assert parse(Cfg, ["--init_kl_coef", "0.1", "--algo.kl.init_coef", "0.1"]).algo.kl.init_coef == 0.1
    assert parse(Cfg, ["--init_kl_coef", "0.1", "--init_kl_coef", "0.3"]).algo.kl.init_coef == 0.3
    with pytest.raises(ConfigError, match=r"--use_kl_loss and --no-algo.kl.use_loss"):
        parse(Cfg, ["--use_kl_loss", "--no-algo.kl.use_loss"], raise_errors=True)


def test_a_flat_name_declared_on_two_flags_sets_both_and_a_switch_stands_for_its_value():
    c = parse(Cfg, ["--max_norm", "0.5", "--bf16"])
    assert (c.actor.max_norm, c.critic.max_norm, c.actor.dtype, c.critic.dtype) == (0.5, 0.5, "bf16", "bf16")
    with pytest.raises(ConfigError, match="set the same flag"):
        parse(Cfg, ["--max_norm", "0.5", "--critic.max_norm", "0.7"], raise_errors=True)


def test_help_lists_each_flag_once_with_both_names_by_section(capsys):
    text = build_parser(Cfg).format_help()
    assert "--algo.kl.init_coef INIT_COEF, --init_kl_coef INIT_COEF" in text
    assert text.count("--algo.kl.init_coef") == 1
    assert "actor:" in text and "algo.kl:" in text
    assert {"actor.adam.lr", "actor_learning_rate", "max_norm", "bf16", "zpg"} <= flag_names(Cfg)


def test_yaml_takes_nested_sections_dotted_keys_and_flat_names(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  kl:\n    init_coef: 0.5\nactor.adam.lr: 4.0e-6\ncritic_learning_rate: 5.0e-6\n")
    c = parse(Cfg, ["--config", str(path), "--use_kl_loss"])
    assert (c.algo.kl.init_coef, c.actor.adam.lr, c.critic.adam.lr, c.algo.kl.use_loss) == (0.5, 4e-6, 5e-6, True)
    path.write_text("algo:\n  kl:\n    init_cof: 0.5\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) algo.kl.init_cof"):
        parse(Cfg, ["--config", str(path)], raise_errors=True)


def test_an_inert_flag_given_is_said_and_one_not_given_is_not():
    assert parse(Cfg, ["--zpg", "1"]).notices == ["--zpg 1: accepted, but not built here"]
    assert parse(Cfg, []).notices == []


def test_build_takes_flat_and_dotted_names_and_names_an_unknown_one():
    c = build(Cfg, actor_learning_rate=1e-5, **{"algo.kl.init_coef": 0.2})
    assert (c.actor.adam.lr, c.algo.kl.init_coef) == (1e-5, 0.2)
    with pytest.raises(ValueError, match="unknown key"):
        build(Cfg, actor_lr=1e-5)
