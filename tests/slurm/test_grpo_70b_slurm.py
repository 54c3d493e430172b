"""`sbatch launch/grpo_70b.slurm` under a real Slurm, the script unedited; a learner rank killed
-9 mid-run is restarted from the newest checkpoint while the services stay up.

Runs inside the emulated cluster of `make test-slurm` (launch/slurm_emulation/cluster.sh, 4
nodes). The script gets environment overrides only (tiny model, CPU, small batches, 8 steps, a
checkpoint every 2) and `--nodes=4`, as its own usage line shows: the learner on node1+node2
(torchrun, c10d rendezvous across them, gloo), one rollout server on node3, the reward service
on node4. Its #SBATCH lines (--gpus-per-node=8, --cpus-per-task=96, --exclusive) are met by the
emulated nodes as they are.

One job checks both the plain run and the restart (the Slurm suite's time is CI's): once a
checkpoint exists and a step after it ran, the test SIGKILLs global rank 1 (the worker on
node2, not the controller). Slurm ends the learner step (--kill-on-bad-exit), the script starts
a new one with --load_checkpoint, the services (same processes) rejoin it, and the run ends
COMPLETED at the planned step with every step once in the metrics.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from slurm_jobs import cpu_run_env, job_fields, metrics, submit, tails, wait

pytestmark = pytest.mark.slurm

STEPS, SAVE_STEPS = 8, 2
JOB_TIMEOUT_S = 420  # the test measured 97 s on 2 cores (50 s before the kill and restart were part of it)


def _processes() -> dict[int, tuple[int, list[str], list[str]]]:
    """pid -> (parent pid, argv, environment) of every process this test can see (the
    cluster's PID namespace has its own /proc: cluster.sh mounts one)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
            env = (d / "environ").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        out[int(d.name)] = (ppid, argv, env)
    return out


def _python_module(argv: list[str]) -> str | None:
    """``python -m MODULE ...`` -> MODULE (srun and torchrun, which carry the module name among
    their own arguments, are not python -m)."""
    if argv and Path(argv[0]).name.startswith("python") and "-m" in argv[:3]:
        return argv[argv.index("-m") + 1]
    return None


def _services() -> dict[str, int]:
    """The job's service processes by name (--name) -> pid (the process srun started, not the
    children it forked: vLLM's engine core, function-reward workers)."""
    procs = _processes()
    found = {}
    for pid, (ppid, argv, _) in procs.items():
        parent = procs.get(ppid, (0, [], []))[1]
        if _python_module(argv) in ("rollout_service", "reward_service") and _python_module(parent) is None:
            found[argv[argv.index("--name") + 1]] = pid
    return found


def _learner_rank(rank: int) -> int | None:
    """The pid of the learner worker of global rank ``rank`` (torchrun's child, not a process
    it forked)."""
    procs = _processes()
    for pid, (ppid, argv, env) in procs.items():
        parent = procs.get(ppid, (0, [], []))[1]
        if (
            _python_module(argv) == "learner.train_ppo"
            and f"RANK={rank}" in env
            and _python_module(parent) != "learner.train_ppo"
        ):
            return pid
    return None


def test_grpo_70b_script_runs_on_four_nodes_and_restarts_a_killed_learner(tmp_path, tiny_model_dir):
    env = cpu_run_env(tmp_path, tiny_model_dir, steps=STEPS)
    env.update(LEARNER_NODES="2", ROLLOUT_NODES="1", SAVE_STEPS=str(SAVE_STEPS), RESTART_LEARNER="1")
    submit_dir = tmp_path / "submit"  # the job's working directory: its --output lands here
    job = submit("grpo_70b.slurm", 4, env, submit_dir)

    save, logs = tmp_path / "save", tmp_path / "save" / "logs"
    out = submit_dir / f"rayless-rayless-grpo-70b-{job}.out"
    learner = [logs / "learner-node1.log", logs / "learner-node2.log"]
    rollout, reward = logs / "rollout-node3-0.log", logs / "reward-node4.log"
    every_log = [out, *learner, rollout, reward]

    # The kill: after the first checkpoint is complete and a step after it was reported.
    first_ckpt = save / "checkpoints" / f"step_{SAVE_STEPS:08d}" / "state.json"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (first_ckpt.exists() and any(r["step"] > SAVE_STEPS for r in metrics(save))):
        assert job_fields(job)["JobState"] in ("PENDING", "RUNNING"), tails(*every_log)
        assert time.monotonic() < deadline, tails(*every_log)
        time.sleep(0.2)
    services_before = _services()
    rank1 = _learner_rank(1)
    assert rank1 is not None and len(services_before) == 2, (rank1, services_before)
    os.kill(rank1, signal.SIGKILL)
    killed_at = max(r["step"] for r in metrics(save))
    assert killed_at < STEPS, "the run ended before the kill: lengthen it"

    # The services are the same processes once the resumed learner trains.
    while "resumed from" not in learner[0].read_text() or max(r["step"] for r in metrics(save)) <= killed_at:
        assert job_fields(job)["JobState"] == "RUNNING", tails(*every_log)
        assert time.monotonic() < deadline, tails(*every_log)
        time.sleep(0.5)
    services_after = _services()
    fields = wait(job, max(deadline - time.monotonic(), 1))

    why = tails(*every_log)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields["JobState"], why)
    assert fields["NodeList"] == "node[1-4]", fields["NodeList"]
    assert services_after == services_before, (services_before, services_after)
    # CURVE is on by default: the script made the run's keys and every role got --auth_dir.
    assert (save / "auth" / "authorized" / "peer.key").exists()

    # Logs land where the script says: the job's output in its working dir, one per role and node.
    assert all(p.exists() for p in every_log), sorted(str(p) for p in logs.iterdir())
    job_out = out.read_text()
    assert "learner: node1 node2 (x1)  rollout: node3 (x1, TP 1)  reward: node4" in job_out, job_out

    # The restart: one, from the newest checkpoint at the kill, by the script.
    assert job_out.count("restarting the learner from the newest checkpoint") == 1, job_out
    assert "(restart 1 of 1); the services stay up" in job_out, job_out
    assert re.search(r"learner exited [1-9]\d*\n", job_out) and job_out.rstrip().count("learner exited 0") == 1, job_out
    node1 = learner[0].read_text()
    k = int(re.search(r"resumed from \S+step_(\d+): step (\d+)", node1).group(2))
    assert k % SAVE_STEPS == 0 and SAVE_STEPS <= k <= killed_at, (k, killed_at)

    # The learner trained every step once: rank 0's metrics have steps 1..STEPS (the killed
    # run's steps after k were dropped and done again), each on the full batch, and the first
    # samples after the restart came from the resumed weights (lockstep: version step - 1).
    # Both ranks took part: ZeRO-3 gathers and reduces across them in every step, and the
    # torchrun on node2 ran global rank 1 of 2 and, the second time, saw it finish.
    rows = metrics(save)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), why
    assert all(r["samples"] == 16 for r in rows), [r["samples"] for r in rows]
    assert [r["rollout/min_policy_version"] for r in rows] == list(range(STEPS)), rows
    # The reward function's extra_logs reach the metrics: the demo task logs its reward as accuracy.
    assert all(r["reward/accuracy"] == pytest.approx(r["rollout/reward"]) for r in rows), rows
    node2 = learner[1].read_text()
    assert "global_ranks=[1]" in node2 and "global_world_sizes=[2]" in node2, tails(learner[1])
    assert "worker group successfully finished" in node2, tails(learner[1])
    assert (save / "config.json").exists(), sorted(p.name for p in save.iterdir())  # the final HF model

    # The services rejoined the restarted learner, then exited on its Shutdown; none was killed.
    rollout_log, reward_log = rollout.read_text(), reward.read_text()
    for text in (rollout_log, reward_log):
        assert "reconnected to the controller" in text or "welcomed again" in text, text[-3000:]
    assert "shutdown requested by the controller" in rollout_log, tails(rollout)
    assert "Shutdown from the controller" in reward_log, tails(reward)
    assert "rollout-node3-0 exited 0" in job_out and "reward-node4 exited 0" in job_out, job_out
    assert "after the learner ended: killed" not in job_out, job_out
    print(f"killed rank 1 after step {killed_at}; resumed from step {k}")
