"""`sbatch launch/grpo_colocated.slurm` under a real Slurm (the emulated cluster of `make
test-slurm`), the script unedited: environment overrides only (tiny model, CPU, 3 steps) and
`--nodes=2`. Each node runs its learner rank (torchrun, c10d rendezvous on node1, gloo), its
rollout server and its reward service side by side, the colocated layout; on CPU the sleep
flags cannot act and say so once, and the run trains every step in lockstep's order.

Its prompts run as agent episodes (``AGENT_FUNC_PATH``, the e2e agent file written for
OpenRLHF): the script gives the file to the learner and every rollout server, and its reward
services serve the reference model only (KL is on: the episodes go to them for the reference's
log-probs, while the agent's rewards are the reward). The one run of the suite with agents and KL.
"""

from __future__ import annotations

import pytest
from slurm_jobs import ROOT, cpu_run_env, metrics, submit, tails, wait

pytestmark = pytest.mark.slurm

STEPS = 3
JOB_TIMEOUT_S = 480


def test_grpo_colocated_script_runs_learner_and_services_on_every_node(tmp_path, tiny_model_dir):
    env = cpu_run_env(tmp_path, tiny_model_dir, steps=STEPS)
    env.update(VLLM_GPU_MEMORY_UTILIZATION="0.5", AGENT_FUNC_PATH=str(ROOT / "examples" / "agents" / "agent_func.py"))
    submit_dir = tmp_path / "submit"
    job = submit("grpo_colocated.slurm", 2, env, submit_dir)
    fields = wait(job, JOB_TIMEOUT_S)

    save, logs = tmp_path / "save", tmp_path / "save" / "logs"
    out = submit_dir / f"rayless-rayless-grpo-colocated-{job}.out"
    learner = [logs / "learner-node1.log", logs / "learner-node2.log"]
    services = [logs / f"rollout-node{n}-0.log" for n in (1, 2)] + [logs / f"reward-node{n}.log" for n in (1, 2)]
    why = tails(out, *learner, *services)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields["JobState"], why)
    assert fields["NodeList"] == "node[1-2]", fields["NodeList"]
    job_out = out.read_text()
    assert "colocated on node1 node2: x1 learner ranks and x1 rollout servers (TP 1) per node" in job_out, job_out

    # Both ranks trained every step in the colocated schedule, each step on the full batch.
    rows = metrics(save)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), why
    assert all(r["samples"] == 16 for r in rows), [r["samples"] for r in rows]
    # Agent episodes, scored by their agent, with the reference's KL from the reward services.
    assert all(r["agent/turns"] >= 1 for r in rows) and all(r["policy/kl_to_ref"] >= 0 for r in rows), rows
    for log in services[:2]:
        assert "agent agent_func.py:" in log.read_text(), tails(log)  # each server loaded the file
    assert "global_ranks=[1]" in learner[1].read_text(), tails(learner[1])
    rank0 = learner[0].read_text()
    assert "schedule: colocated" in rank0, tails(learner[0])
    for flag in ("vllm_enable_sleep", "deepspeed_enable_sleep", "vllm_gpu_memory_utilization"):
        assert rank0.count(f"--{flag} cannot act here") == 1, (flag, tails(learner[0]))
    # The rollout servers got the colocated engine flags.
    assert "--enable_sleep: vLLM has no sleep mode on CPU" in services[0].read_text(), tails(services[0])

    assert "learner exited 0" in job_out, job_out
    for name in ("rollout-node1-0", "rollout-node2-0", "reward-node1", "reward-node2"):
        assert f"{name} exited 0" in job_out, job_out
    assert "killed" not in job_out, job_out
