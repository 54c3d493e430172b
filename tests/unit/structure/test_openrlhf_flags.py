"""Every flag of OpenRLHF 0.10's commands is accepted by rayless's counterpart: with OpenRLHF's
meaning, or marked inert and said at start-up (never "unrecognized arguments", never silently
ignored). The list is checked in (``openrlhf_0_10_flags.txt``, with the commit it was read from)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from common.config import build_parser, flag_names, leaves

LIST = Path(__file__).with_name("openrlhf_0_10_flags.txt")

# OpenRLHF's command -> (rayless module, its config class)
COUNTERPARTS = {
    "train_ppo_ray": ("learner.rl.config", "PPOConfig"),
    "train_sft": ("learner.train_sft", "SFTConfig"),
    "train_rm": ("learner.train_rm", "RMConfig"),
    "train_dpo": ("learner.train_dpo", "DPOConfig"),
    "serve_rm": ("reward_service.serve_rm", "ServeRMConfig"),
    "lora_combiner": ("learner.lora_combine", "LoraCombineConfig"),
}


def openrlhf_flags() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in LIST.read_text().splitlines():
        if line and not line.startswith("#"):
            command, name = line.split()
            out.setdefault(command, []).append(name)
    return out


def config_class(command: str) -> type:
    module, name = COUNTERPARTS[command]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"OpenRLHF's {command} has no rayless counterpart {module}.{name}: {e}")


def test_the_list_names_every_command_and_was_read_from_a_commit():
    assert set(openrlhf_flags()) == set(COUNTERPARTS)
    assert "3c3be6234e0cb353e76bb8019947db9dfe99fca7" in LIST.read_text()


@pytest.mark.parametrize("command", sorted(COUNTERPARTS))
def test_every_flag_of_the_openrlhf_command_is_accepted(command):
    cls = config_class(command)
    accepted = flag_names(cls)
    missing = [f for f in openrlhf_flags()[command] if f not in accepted]
    # OpenRLHF's negations (--X.no_Y) are the --no- spelling here: accepted as long as Y is
    negated = [f for f in missing if ".no_" in f and f.replace(".no_", ".", 1) in accepted]
    assert sorted(set(missing) - set(negated)) == [], f"{command}: flags rayless does not accept"


@pytest.mark.parametrize("command", sorted(COUNTERPARTS))
def test_the_parser_of_each_counterpart_builds_with_both_spellings_once(command):
    """--help lists each flag once with both its names (argparse refuses a name given twice)."""
    cls = config_class(command)
    build_parser(cls)
    paths = [leaf.path for leaf in leaves(cls)]
    assert len(paths) == len(set(paths))


# OpenRLHF 0.10's example scripts (examples/scripts/*.sh at the same commit), as the argv each
# passes to its command: the flags and values, read by running the script with its launcher
# recorded. The Slurm script starts Ray itself and is not here (launch/grpo_70b.slurm is ours).
EXAMPLES = Path(__file__).with_name("openrlhf_0_10_examples.json")

# What differs on purpose, said where the run refuses it.
REFUSED = {
    # OpenRLHF's async agent example time-shares the GPUs (colocated) while generating async, with
    # vLLM pausing for each push; rayless's async schedule generates while the learner trains, so
    # the two do not share devices: the run says so and how to choose.
    "train_reinforce_baseline_ray_agent_async": "--colocate_all_models and --async_train contradict each other",
}


def _swapped(argv: list[str]) -> list[str]:
    """The example's argv with its files swapped for local ones (what a user swaps with the model)."""
    agent = str(Path(__file__).parents[3] / "examples" / "agents" / "agent_func.py")
    return [agent if a.endswith("agent_func.py") else a for a in argv]


@pytest.mark.parametrize("script", sorted(__import__("json").loads(EXAMPLES.read_text())))
def test_openrlhf_example_scripts_parse_with_only_the_module_swapped(script):
    from common.config import ConfigError, parse

    example = __import__("json").loads(EXAMPLES.read_text())[script]
    cls = config_class(example["command"])
    argv = _swapped(example["argv"])
    if script in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[script]):
            parse(cls, argv, raise_errors=True)
        return
    cfg = parse(cls, argv, raise_errors=True)
    notices = getattr(cfg, "notices", [])
    assert all(": accepted, but " in n or "--" in n for n in notices)
