"""End to end: GRPO through launch.local with real vLLM, the reward service and DeepSpeed, with
its evaluations and tracking (metrics.jsonl, TensorBoard, an offline wandb run).

Slow (each starts vLLM); run in CI all the same. The reward is one the tiny random model can
learn in a handful of steps (tests/helpers/reward_first_char_parity.py); learning is checked
on the exact probability of a rewarded first token before and after, not on sampled rewards
(two runs' sampled curves differ: vLLM's batching order is not reproducible).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest

from helpers.e2e_launch import addition_prompts, cpu_env, finish, local_cmd, metrics, rewarded_mass, start
from helpers.listening import Watch
from helpers.wandb_offline import history, missing_from_history, offline_env, offline_runs, records, run_info

pytestmark = pytest.mark.slow


def _launch(
    tmp_path: Path,
    model: Path,
    *,
    steps: int,
    servers: int,
    extra_learner: list[str] = (),
    extra_local: list[str] = (),
    env: dict[str, str] | None = None,
    fleet=None,
):
    learner = [
        *("--prompt_data", str(addition_prompts(tmp_path / "prompts.jsonl")), "--input_key", "input"),
        *("--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "16"),
        *("--train_batch_size", "128", "--micro_train_batch_size", "128", "--micro_rollout_batch_size", "128"),
        *("--max_steps", str(steps), "--generate_max_len", "4", "--actor_learning_rate", "3e-3"),
        *("--init_kl_coef", "0", "--zero_stage", "2", "--seed", "0", "--peer_timeout_s", "5"),
        *extra_learner,
    ]
    if fleet is not None:
        return start(local_cmd(tmp_path / "run", model, learner, fleet=fleet, extra=extra_local), env)
    cmd = local_cmd(tmp_path / "run", model, learner, extra=["--rollout_servers", str(servers), *extra_local])
    return start(cmd, env)


def _eval_prompts(path: Path) -> Path:
    """16 held-out prompts (the training ones have a < 30) in two data sources."""
    rows = [
        {"input": f"{a}+{b}=", "datasource": "low" if b < 2 else "high"} for a in (30, 31, 32, 33) for b in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grpo_learns_through_real_services(tmp_path, tiny_model_dir, shared_fleet):
    """Also the tracking and evaluation of a run: --eval_steps 5 evaluates at steps 0, 5, 10 and
    12 (the last), per data source, and metrics.jsonl, TensorBoard and the offline wandb run
    (read back with wandb's own reader) all hold those evaluations; wandb holds every key and
    step of metrics.jsonl. The run joins the session's shared fleet, which earlier runs trained
    other weights into: it learns from its own (the first push), and leaves the fleet serving."""
    steps = 12
    evaluation = [
        *("--eval_dataset", str(_eval_prompts(tmp_path / "eval.jsonl")), "--eval_steps", "5"),
        *("--eval_n_samples_per_prompt", "2", "--use_wandb", "True", "--log_samples_steps", "5"),
    ]
    env = cpu_env(**offline_env(tmp_path / "wandb_home"))
    mark = shared_fleet.log_mark()
    proc = _launch(
        tmp_path, tiny_model_dir, steps=steps, servers=1, extra_learner=evaluation, env=env, fleet=shared_fleet
    )
    out = finish(proc, 600)
    run = tmp_path / "run"
    assert proc.returncode == 0, out[-4000:]
    rows = [m for m in metrics(run) if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    print("rewards per step:", [m["rollout/reward"] for m in rows])
    # Learning, measured without sampling noise: the exact probability of a rewarded first
    # token under the trained policy vs the initial one, over 50 training prompts.
    prompts = [json.loads(line)["input"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()[:50]]
    before, after = rewarded_mass(tiny_model_dir, prompts), rewarded_mass(run / "model", prompts)
    print(f"rewarded first-token mass: {before:.3f} -> {after:.3f}")
    assert after > before + 0.1, (before, after)
    # vLLM and the learner agree on log-probs: the weights arrived and numerics match (fp32;
    # measured ~5e-7) -- from step 1, so the fleet's earlier weights were replaced by this run's.
    assert max(m["rollout/logprob_diff"] for m in rows) < 1e-3, [m["rollout/logprob_diff"] for m in rows]
    assert all(m["samples"] == 128 for m in rows)
    # After each step the rollout server reported the new policy version (its log since this run).
    versions = {int(v) for v in re.findall(r"policy version (\d+)", shared_fleet.log_since(mark))}
    assert set(range(0, steps + 1)) <= versions, sorted(versions)
    _check_tracking(run, steps)


def _check_tracking(run: Path, steps: int) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    written = metrics(run)
    evals = [m for m in written if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 5, 10, steps]
    for m in evals:  # the weights pushed just before; 8 prompts x 2 samples per source
        assert m["eval/policy_version"] == m["step"] and m["eval/low/prompts"] == m["eval/high/prompts"] == 8
        assert {"eval/low/pass@1", "eval/high/pass@2", "eval/low/truncated_frac", "eval/pass@2"} <= set(m)
    tb = EventAccumulator(str(run / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("eval/accuracy")] == [0, 5, 10, steps]
    (wandb_run,) = offline_runs(run)  # beside metrics.jsonl
    recs = records(wandb_run)
    assert missing_from_history(written, history(recs)) == []
    assert run_info(recs)["project"] == "rayless_train_ppo"
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({(r["step"], r["split"]) for r in samples}) == [
        (0, "eval"), (5, "eval"), (5, "train"), (10, "eval"), (10, "train"), (steps, "eval")
    ]  # fmt: skip


@pytest.mark.breaks_fleet
def test_killed_rollout_server_work_is_reissued_and_run_completes(tmp_path, tiny_model_dir, shared_fleet):
    """One of the shared fleet's two rollout servers SIGKILLed mid-run: what it held is
    re-issued, every step trains a full batch, the run ends well on the other. And Dr. GRPO with
    clip-higher and dual clip runs through the real services here (finite losses)."""
    steps = 6
    dr_grpo = ["--advantage_estimator", "dr_grpo", "--loss_agg_mode", "seq_mean_token_sum_norm"]
    dr_grpo += ["--eps_clip_low_high", "0.2", "0.28", "--dual_clip", "3"]
    extra = ["--generate_max_len", "24", *dr_grpo]
    proc = _launch(tmp_path, tiny_model_dir, steps=steps, servers=2, extra_learner=extra, fleet=shared_fleet)
    run = tmp_path / "run"
    deadline = time.monotonic() + 600
    _kill_after_step_2(proc, run, deadline, shared_fleet)
    out = finish(proc, max(60.0, deadline - time.monotonic()))
    assert proc.returncode == 0, out[-4000:]
    rows = [m for m in metrics(run) if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    # Every step trained exactly its 16 prompts x 8 samples: nothing lost, nothing twice.
    assert all(m["samples"] == 128 for m in rows)
    last = rows[-1]
    learner_log = (run / "logs" / "learner.log").read_text()
    # One death: rollout-1's. A fleet service reconnecting from the previous test's learner can
    # have two Hellos delivered when this learner binds (one queued, one resent): the pool takes
    # the second for a restart holding nothing (seen once in CI; the Hello carries no incarnation
    # to tell them apart: an open item, docs/testing.md).
    spurious = re.findall(r"\(reward\) is gone: restarted \(said Hello again\); 0 work item", learner_log)
    assert last["pool/died"] == 1 + len(spurious), learner_log[-3000:]
    # What it held came back through the ledger. Usually step 3's prompts; on a loaded machine
    # the kill can land before they were sent, and the server is found gone holding none
    # (seen in CI: "0 work item(s) it held"), which is not a loss either. Or it lands inside the
    # submit of step 3: a first send to it was taken, a later one failed ("unreachable (send
    # failed)", seen in CI with 4 held): the ledger had not started those prompts, they stay
    # queued and go to the other server on the next turn without a re-issue.
    gone = re.findall(r"rollout-1 \(rollout\) is gone: (.*?); (\d+) work item", learner_log)
    reissued = [int(x) for x in re.findall(r"re-issuing (\d+) prompt\(s\) held by rollout-1", learner_log)]
    assert gone, learner_log[-3000:]
    reason, held = gone[0][0], int(gone[0][1])
    expect_reissue = held >= 1 and not reason.startswith("unreachable (send failed)")
    assert (sum(reissued) >= 1) == expect_reissue and sum(reissued) <= held, (reason, held, reissued)
    assert last["ledger/reissued"] >= sum(reissued), learner_log[-3000:]
    assert all(math.isfinite(m["policy/policy_loss"]) for m in rows), [m["policy/policy_loss"] for m in rows]


def _kill_after_step_2(proc, run: Path, deadline: float, fleet) -> None:
    """Kills the fleet's rollout-1 the moment step 2 is written: step 3's prompts are being
    generated."""
    while time.monotonic() < deadline and proc.poll() is None:
        if any(m.get("step", 0) >= 2 and "rollout/reward" in m for m in metrics(run)):
            fleet.kill("rollout-1")
            return
        time.sleep(0.01)
    pytest.fail("rollout-1 was never killed:\n" + (proc.stdout.read() if proc.poll() is not None else "")[-4000:])


def _check_loopback_auth_and_shutdown(run: Path, listening: Watch, out: str) -> None:
    assert (run / "auth" / "authorized" / "peer.key").exists()
    assert "--auth_dir" in (run / "logs" / "rollout-0.log").read_text().splitlines()[0]
    # Nothing of the run listens beyond loopback (docs/security.md): not the controller, the
    # learner's rendezvous store or its weight group's store (torch's own would listen on every
    # interface), gloo, nor vLLM's sockets. The learner's ports seen include the controller's.
    assert not [lst for lst in listening.seen if not lst.loopback], sorted(listening.seen, key=str)
    learner_cmd = (run / "logs" / "learner.log").read_text().splitlines()[0]
    controller_port = int(re.search(r"--controller_bind tcp://127\.0\.0\.1:(\d+)", learner_cmd).group(1))
    learner_ports = {lst.port for lst in listening.seen if "learner.train_ppo" in lst.cmd}
    assert controller_port in learner_ports and len(learner_ports) >= 3, sorted(listening.seen, key=str)
    # The learner's Shutdown reached every service left: none had to be killed by launch.local.
    assert "did not exit within" not in out, out[-4000:]
