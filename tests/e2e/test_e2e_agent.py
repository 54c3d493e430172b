"""End to end: multi-turn agent RL through launch.local, real vLLM and DeepSpeed, with an agent
file written for OpenRLHF (``examples/agents/agent_func.py``) used unchanged.

The run joins the session's shared fleet, whose rollout servers load that file. The async
schedule with agents, and a rollout server SIGKILLed mid-episode, are checked on the killed-server
run of ``test_e2e_async_faults.py``.
"""

from __future__ import annotations

import json

import pytest

from helpers.e2e_launch import AGENT_EXAMPLE, addition_prompts, finish, local_cmd, metrics, rewarded_mass, start

pytestmark = pytest.mark.slow


def test_agent_episodes_train_lockstep_from_an_openrlhf_agent_file(tmp_path, tiny_model_dir, shared_fleet):
    """Every prompt runs as an episode of up to three tries on the rollout servers; the agent's
    summed rewards are the reward (no reward service is asked: KL is off). Checked: every step
    trains its 16 x 8 episodes; episodes take more than one action on average and carry the
    environment's tokens (context only: rollout/response_len counts the policy's); the learner's
    and vLLM's log-probs of the action tokens agree (the mask lines up through turns); evaluation
    runs episodes too; and the policy learns what the environment rewards (each action's first
    character), measured exactly on the model rather than on sampled rewards."""
    steps = 10
    prompts = addition_prompts(tmp_path / "prompts.jsonl")
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"input": f"{a}+1="}) + "\n" for a in range(30, 38)))
    learner = [
        *("--prompt_data", str(prompts), "--input_key", "input", "--agent_func_path", str(AGENT_EXAMPLE)),
        *("--max_len", "48", "--agent_max_turns", "3", "--generate_max_len", "4"),
        *("--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "16"),
        *("--train_batch_size", "128", "--micro_train_batch_size", "128", "--micro_rollout_batch_size", "128"),
        *("--max_steps", str(steps), "--actor_learning_rate", "3e-3", "--packing_samples"),
        *("--init_kl_coef", "0", "--zero_stage", "2", "--seed", "0", "--peer_timeout_s", "5"),
        *("--eval_dataset", str(evals), "--eval_steps", str(steps)),
    ]
    run = tmp_path / "run"
    proc = start(local_cmd(run, tiny_model_dir, learner, fleet=shared_fleet))
    out = finish(proc, 600)
    assert proc.returncode == 0, out[-4000:]
    rows = [m for m in metrics(run) if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    assert all(m["samples"] == 128 for m in rows)
    print("reward, turns per step:", [(round(m["rollout/reward"], 2), round(m["agent/turns"], 2)) for m in rows])
    assert all(1 < m["agent/turns"] <= 3 and m["agent/env_tokens"] > 0 for m in rows[:3]), rows[0]
    assert all(m["rollout/response_len"] <= 3 * 4 for m in rows)  # actions only: at most 3 turns of 4
    assert max(m["rollout/logprob_diff"] for m in rows) < 1e-3, [m["rollout/logprob_diff"] for m in rows]
    assert rows[-1]["agent/failed_episodes"] == 0
    # The agent's extra_logs reach the metrics (agent/<name>, means over the step's episodes): the
    # example logs its step() calls as tries (one per action: the episode's turns) and whether the
    # last was right, and an episode's reward is 1 per right step and -0.5 per wrong one, so
    # reward = 1.5 right - 0.5 tries, episode by episode and so in the means.
    for m in rows:
        assert m["agent/tries"] == pytest.approx(m["agent/turns"]) and 0 <= m["agent/right"] <= 1, m
        assert m["rollout/reward"] == pytest.approx(1.5 * m["agent/right"] - 0.5 * m["agent/tries"], abs=1e-5), m
    (last_eval,) = [m for m in metrics(run) if "eval/accuracy" in m and m["step"] == steps]
    assert last_eval["eval/prompts"] == 8 and last_eval["eval/turns"] >= 1
    learner_log = (run / "logs" / "learner.log").read_text()
    assert "the agent scores its episodes, no reward service is waited for" in learner_log
    texts = [json.loads(line)["input"] for line in prompts.read_text().splitlines()[:50]]
    before, after = rewarded_mass(tiny_model_dir, texts), rewarded_mass(run / "model", texts)
    print(f"rewarded first-token mass: {before:.3f} -> {after:.3f}")
    assert after > before + 0.1, (before, after)
