"""End to end: the colocated schedule (``--colocate_all_models``) through launch.local with real
vLLM, the reward service and DeepSpeed, on CPU.

On CPU neither half can act: vLLM has no sleep mode (the server answers ``Sleep`` with
not_supported) and DeepSpeed's states already live in host memory. The schedule then runs in
lockstep's order with gloo weights, each flag saying once why it cannot act, and learns as the
lockstep run of ``test_e2e_grpo`` does (same job, same check: the exact probability of a
rewarded first token before and after).

This run has a fleet of its own (its server needs the sleep flags), so it is also where what
needs every process of a run is checked: CURVE on (launch.local --auth; the rest of the suite
runs without, so both paths stay covered), nothing listening beyond loopback, the learner's
Shutdown reaching every service at the end. Its prompts run as agent episodes
(``examples/agents/agent_func.py``, which rewards what the reward function would, summed over up
to three tries): the colocated schedule with agents, at no run of its own; the idle reward
service still gets its Shutdown.
"""

from __future__ import annotations

import json
import re

import pytest
from test_e2e_grpo import _check_loopback_auth_and_shutdown, _launch

from helpers.e2e_launch import AGENT_EXAMPLE, finish, metrics, rewarded_mass
from helpers.listening import Watch

pytestmark = pytest.mark.slow

COLOCATED = [
    "--colocate_all_models",
    "--vllm_enable_sleep",
    "--deepspeed_enable_sleep",
    "--vllm_gpu_memory_utilization",
    "0.5",
]
AGENT = ["--agent_func_path", str(AGENT_EXAMPLE), "--max_len", "48", "--agent_max_turns", "3"]


def test_colocated_learns_on_cpu_and_each_flag_says_once_it_cannot_act(tmp_path, tiny_model_dir):
    steps = 12
    extra = [*COLOCATED, *AGENT]
    proc = _launch(tmp_path, tiny_model_dir, steps=steps, servers=1, extra_learner=extra, extra_local=["--auth"])
    with Watch(proc.pid) as listening:  # every process of the run, sampled as it goes
        out = finish(proc, 600)
    run = tmp_path / "run"
    assert proc.returncode == 0, out[-4000:]
    _check_loopback_auth_and_shutdown(run, listening, out)
    learner_log = (run / "logs" / "learner.log").read_text()
    rollout_log = (run / "logs" / "rollout-0.log").read_text()
    assert "schedule: colocated" in learner_log
    # launch.local passed the engine half of the flags to the rollout server.
    first = rollout_log.splitlines()[0]
    assert "--enable_sleep" in first and "--gpu_memory_utilization 0.5" in first and "--agent_func_path" in first
    assert "--enable_sleep: vLLM has no sleep mode on CPU" in rollout_log
    # Each flag that cannot act says so once, with why.
    said = re.findall(r"--(\w+) cannot act here: (.*)", learner_log)
    assert sorted(flag for flag, _ in said) == [
        "deepspeed_enable_sleep",
        "vllm_enable_sleep",
        "vllm_gpu_memory_utilization",
    ], said
    why = dict(said)
    assert why["vllm_enable_sleep"].startswith("rollout-0: sleep/wake not supported: vLLM has no sleep mode on CPU")
    assert why["deepspeed_enable_sleep"].startswith("the learner trains on CPU")
    assert "VLLM_CPU_KVCACHE_SPACE" in why["vllm_gpu_memory_utilization"]
    # Lockstep semantics: every step trains its 16 prompts x 8 samples, all from the weights
    # pushed after the step before; the weights arrive (log-probs agree, fp32).
    rows = [m for m in metrics(run) if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    assert all(m["samples"] == 128 for m in rows) and any(m["agent/turns"] > 1 for m in rows)
    assert [m["rollout/min_policy_version"] for m in rows] == list(range(steps))
    assert max(m["rollout/logprob_diff"] for m in rows) < 1e-3, [m["rollout/logprob_diff"] for m in rows]
    # Learning, as the lockstep e2e test measures it.
    prompts = [json.loads(line)["input"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()[:50]]
    before, after = rewarded_mass(tiny_model_dir, prompts), rewarded_mass(run / "model", prompts)
    print(f"rewarded first-token mass: {before:.3f} -> {after:.3f}")
    assert after > before + 0.1, (before, after)
