"""``--agent_func_path``'s identity and its hub form (common/agent_file.py): ``gem:ENV_ID?k=v``
parsed and named canonically without GEM installed, the hubs not adapted refused with why, and
the learner and launch.local taking a spec as it is. Playing GEM: rollout_service/test_hub_envs.py.
"""

from __future__ import annotations

import pytest

from common.agent_file import HubSpec, agent_argument, agent_identity, check_agent_path, hub_spec

GUESS = "gem:game:GuessTheNumber-v0-easy"


def test_spec_syntax_identity_and_refusals():
    spec = hub_spec("gem:game:Sudoku-v0-easy?max_turns=8&system=Be brief&ids=[1,2]")
    assert spec == HubSpec("gem", "game:Sudoku-v0-easy", {"max_turns": 8, "system": "Be brief", "ids": [1, 2]})
    # the identity is canonical: the learner names it without GEM installed, in any key order
    assert agent_identity("gem:game:Sudoku-v0-easy?system=Be brief&ids=[1, 2]&max_turns=8") == (
        'gem:game:Sudoku-v0-easy?ids=[1,2]&max_turns=8&system="Be brief"'
    )
    assert hub_spec("examples/agents/agent_func.py") is None
    assert agent_argument("gem:x:Y-v0") == "gem:x:Y-v0"
    check_agent_path("gem:x:Y-v0")
    for bad, why in [
        ("gem:", "no environment id"),
        ("gem:x?turns", "is not key=value"),
        ("gem:x?a=1&a=2", "given twice"),
        ("openenv:echo", "openenv environments are not supported yet .*pillow"),
        ("verifiers:gsm8k", "verifiers environments are not supported yet .*openai<3"),
    ]:
        with pytest.raises(ValueError, match=f"--agent_func_path {bad}.*{why}".replace("?", r"\?")):
            hub_spec(bad)
    with pytest.raises(ValueError, match=r"a Python file \(\.py\) or a hub environment \(gem:ENV_ID\)"):
        check_agent_path("env.txt")


def test_the_learner_and_launch_local_take_a_spec_as_it_is():
    from common.config import build
    from launch.local import _rollout_flags_from_learner
    from learner.rl.config import PPOConfig

    base = dict(pretrain="m", prompt_data="p", rollout_batch_size=2, n_samples_per_prompt=2, train_batch_size=4)
    c = build(PPOConfig, **base, micro_train_batch_size=2, agent_func_path=GUESS + "?max_turns=3", init_kl_coef=0.0)
    assert c.agent_params().agent == GUESS + "?max_turns=3"  # named without reading a file
    flags = _rollout_flags_from_learner(c)
    assert flags[flags.index("--agent_func_path") + 1] == GUESS + "?max_turns=3"
