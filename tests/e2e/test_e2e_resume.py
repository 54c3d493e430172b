"""End to end: a learner killed -9 mid-run is restarted by ``launch.local --restart_learner``
from its newest checkpoint, while the rollout server (vLLM) and the reward service stay up.

What is asserted, and what is not:
- the resumed learner continues at k+1 and ends at the planned step, each step in
  metrics.jsonl exactly once (the killed run's steps after k are dropped and done again);
- the prompts trained at every step (``data/prompts_crc``) are those of an uninterrupted
  run: the PromptStream's batch for that step, and equal to what the killed run trained at
  the steps it did after k;
- the services (the session's shared fleet: tests/helpers/shared_fleet.py) kept their
  processes, rejoined the new controller, and the first samples after the restart came from
  the resumed weights (policy version k), not from the killed run's later ones nor from the
  weights an earlier test's run left in them;
- vLLM and the learner agree on log-probs after the restart (the resumed weights arrived);
- with --seed_sampling (each prompt's seed from its stream position, not from the controller's
  prompt ids, which restart at 0) and fp32, the per-step rewards and losses of the steps the
  killed run did after k equal the resumed run's to 1e-4: the killed run is the uninterrupted
  run up to its kill, from the very state the checkpoint holds.
The learner-side state (weights, optimizer, LR schedule, RNGs, KL) is also checked exactly in
tests/unit/rl/test_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.e2e_launch import cpu_env, local_cmd, metrics, rewarded_mass, start
from helpers.shared_fleet import SERVICES, SharedFleet
from helpers.wandb_offline import history, missing_from_history, offline_env, offline_runs, records, run_info

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY, KILL_AFTER = 9, 3, 5  # steps take ~0.2 s: the kill lands after step 5 or a little later


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"{a}+{b}="}) + "\n" for a in range(10) for b in range(10)))
    return path


def _learner_flags(prompts: Path) -> list[str]:
    return [
        "--prompt_data", str(prompts), "--input_key", "input", "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
        "--train_batch_size", "32", "--micro_train_batch_size", "32",
        "--max_steps", str(STEPS), "--generate_max_len", "4",
        "--actor_learning_rate", "1e-3", "--init_kl_coef", "0", "--zero_stage", "2", "--seed", "0",
        "--peer_timeout_s", "30", "--save_steps", str(SAVE_EVERY),
        # A learner killed during a weight push: the server fails the open update and drops the
        # group once it finds the controller gone (RolloutCore.abort_weight_sync); a short
        # timeout bounds any join still aimed at the dead learner's store.
        "--weight_sync_timeout_s", "20",
    ]  # fmt: skip


def _expected_crcs(tiny_model_dir: Path, prompts: Path) -> dict[int, int]:
    """What an uninterrupted run trains at each step: the PromptStream's batch."""
    from transformers import AutoTokenizer

    from common.config import build
    from learner.rl.config import PPOConfig
    from learner.rl.prompts import PromptStream, fingerprint, load_prompt_items

    cfg = build(PPOConfig, pretrain=str(tiny_model_dir), **{
        "prompt_data": str(prompts), "input_key": "input", "n_samples_per_prompt": 4, "rollout_batch_size": 8,
        "train_batch_size": 32, "micro_train_batch_size": 32, "seed": 0,
    })  # fmt: skip
    stream = PromptStream(load_prompt_items(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), str(prompts)), 8)
    return {s: fingerprint(it.tokens for it in stream.batch(s)) for s in range(1, STEPS + 1)}


def _run_killing_the_learner(
    tmp_path: Path, model: Path, learner: list[str], fleet: SharedFleet, env: dict[str, str] | None = None
) -> tuple[str, dict[int, dict]]:
    """One launch.local run with ``--restart_learner 1`` on the session's shared fleet: the
    learner is SIGKILLed once step KILL_AFTER is written, and restarted by the launcher, while
    the services stay up; the run must end well, and the services must have stayed the same
    processes and rejoined the restarted learner. Returns the launcher's output and the killed
    run's step rows (read before the resume trims them)."""
    run = tmp_path / "run"
    extra = ["--restart_learner", "1", "--quiet"]
    out_path = tmp_path / "launch.out"
    starts, marks = fleet.starts, {name: fleet.log_mark(name) for name in SERVICES}
    proc = start(local_cmd(run, model, learner, extra=extra, fleet=fleet), env, out=out_path)
    try:
        deadline = time.monotonic() + 600
        while not any(m.get("step", 0) >= KILL_AFTER and "rollout/reward" in m for m in metrics(run)):
            assert proc.poll() is None, out_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "the run never reached the kill point"
            time.sleep(0.1)
        learner_pid = int(re.search(r"started learner \(pid (\d+)\)", out_path.read_text()).group(1))
        os.kill(learner_pid, signal.SIGKILL)
        killed_run = {m["step"]: m for m in metrics(run) if "rollout/reward" in m}
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    out = out_path.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert out.count("started learner") == 2 and "restart 1 of 1" in out
    # the services never restarted (one start each) and rejoined the new controller
    assert fleet.starts == starts and fleet.alive()
    for name, mark in marks.items():
        text = fleet.log_since(mark, name)
        assert "reconnected to the controller" in text or "welcomed again" in text, text[-3000:]
    return out, killed_run


def test_a_killed_learner_resumes_from_its_checkpoint_while_services_stay_up(tmp_path, tiny_model_dir, shared_fleet):
    """The policy trains LoRA adapters (--lora_rank 8) and pushes them alone (--lora_sync adapter:
    vLLM serves the adapter; each learner's first push also brings its base weights): the
    checkpoint holds the adapter and its optimizer state, the servers serve what the learner
    trains (its log-probs are vLLM's, before and after the restart), and the run learns with it.
    Also: both learners log to wandb (offline), and the resumed one continues the killed one's
    wandb run (the id is in the checkpoint)."""
    prompts = _prompts(tmp_path)
    run = tmp_path / "run"
    lora = ["--lora_rank", "8", "--lora_alpha", "16", "--actor_learning_rate", "1e-2"]  # LoRA's LR (docs/trainers.md)
    lora += ["--lora_sync", "adapter"]
    flags = [*_learner_flags(prompts), *lora, "--seed_sampling", "--use_wandb", "True"]
    env = cpu_env(**offline_env(tmp_path / "wandb_home"))
    _, killed_run = _run_killing_the_learner(tmp_path, tiny_model_dir, flags, shared_fleet, env)
    learner_log = (run / "logs" / "learner.log").read_text()
    k = int(re.search(r"resumed from \S+step_(\d+): step (\d+)", learner_log).group(2))
    assert k % SAVE_EVERY == 0 and KILL_AFTER - SAVE_EVERY < k < STEPS, learner_log[-3000:]

    # continues at k+1, ends at the planned step, each step once
    rows = [m for m in metrics(run) if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    # the prompts of every step are the uninterrupted run's
    expected = _expected_crcs(tiny_model_dir, prompts)
    assert {m["step"]: m["data/prompts_crc"] for m in rows} == expected
    assert all(killed_run[s]["data/prompts_crc"] == expected[s] for s in killed_run)
    # the steps done twice (by the killed run after k, and again after the restart) drew the same
    # samples and trained the same: rewards and every policy metric equal to 1e-4
    again = [s for s in killed_run if s > k]
    assert again, f"the kill landed before step {k + 1} was written"
    by_step = {m["step"]: m for m in rows}
    for s in again:
        keys = ["rollout/reward", "rollout/response_len", *sorted(x for x in killed_run[s] if x.startswith("policy/"))]
        diffs = {x: (killed_run[s][x], by_step[s].get(x)) for x in keys if x in killed_run[s]}
        assert all(b is not None and abs(a - b) <= 1e-4 for a, b in diffs.values()), (s, diffs)
        assert len(diffs) > 3, killed_run[s]
    # the first samples after the restart came from the resumed weights, and every step's
    # samples from the previous step's (lockstep), as in an uninterrupted run
    assert [m["rollout/min_policy_version"] for m in rows] == [s - 1 for s in range(1, STEPS + 1)]
    # vLLM served the adapter the learner trained: its log-probs are the learner's (the
    # full-weight level). Each learner sent its base weights once, then adapters alone.
    assert max(m["rollout/logprob_diff"] for m in rows) < 1e-3, [m["rollout/logprob_diff"] for m in rows]
    assert learner_log.count("LoRA rank 8 alpha 16") == 2, learner_log[-3000:]  # both learners
    pushes = re.findall(
        r"pushed v\d+ to \d+ server\(s\) .*?each, (the base weights and the adapter|the adapter)[;)]", learner_log
    )
    assert pushes.count("the base weights and the adapter") == 2 and pushes.count("the adapter") >= STEPS, pushes
    # Learning: the saved model is plain HF (the adapter merged; loaded without peft), and its
    # exact probability of a rewarded first token rose; the adapter alone is saved beside it.
    texts = [json.loads(line)["input"] for line in prompts.read_text().splitlines()[:50]]
    before, after = rewarded_mass(tiny_model_dir, texts), rewarded_mass(run / "model", texts)
    print(f"rewarded first-token mass: {before:.3f} -> {after:.3f}")
    assert after > before + 0.05, (before, after)
    assert (run / "model" / "adapter" / "adapter_config.json").is_file()
    assert sorted(p.name for p in (run / "model" / "checkpoints").iterdir()) == [
        f"step_{s:08d}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)
    ]  # --max_ckpt_num 3
    # One wandb run across the restart: the resumed learner's offline run continues the id the
    # killed one started (its folder is named by it) and the checkpoint kept, from step k+1, with
    # every record of metrics.jsonl from there on. (The killed run's own file is not read: wandb
    # writes it in blocks, and the kill -9 of the learner's process group took its last one.)
    killed_file, resumed_file = offline_runs(run)
    resumed_wandb = records(resumed_file)
    saved = json.loads((run / "model" / "checkpoints" / f"step_{k:08d}" / "state.json").read_text())
    run_id = saved["metrics"]["wandb"]["wandb_run_id"]
    assert killed_file.parent.name.endswith(f"-{run_id}") and run_info(resumed_wandb)["run_id"] == run_id
    resumed_rows = history(resumed_wandb)
    assert [r["step"] for r in resumed_rows] == list(range(k + 1, STEPS + 1))
    assert missing_from_history([m for m in metrics(run) if m["step"] > k], resumed_rows) == []


def _positions(text: str) -> dict[int, list[int]]:
    """step -> the stream positions it trained, from the async schedule's log lines."""
    out = {}
    for step, ranges in re.findall(r"step (\d+) trains stream positions (\S+)", text):
        ps = []
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            ps += range(int(lo), int(hi or lo) + 1)
        out[int(step)] = ps
    return out


def test_a_killed_async_learner_resumes_without_skipping_or_repeating_a_prompt(tmp_path, tiny_model_dir, shared_fleet):
    """--async_train: at each checkpoint prompts are in flight and groups wait in the feed. After
    a kill -9 and a restart from step k's checkpoint, the steps the killed run trained up to k
    and the resumed run's steps k+1.. together train every prompt of the stream exactly once
    (the pending ones issued again, the killed run's steps after k done again), within the
    staleness bound, with the services up throughout. The policy trains LoRA adapters pushed
    merged (--lora_sync merged, the default), the other push mode of the lockstep run above."""
    prompts = _prompts(tmp_path)
    run = tmp_path / "run"
    flags = [*_learner_flags(prompts), "--async_train", "--max_staleness", "1", "--lora_rank", "8"]
    _run_killing_the_learner(tmp_path, tiny_model_dir, flags, shared_fleet)
    learner_log = (run / "logs" / "learner.log").read_text()
    m = re.search(r"resumed from (\S+step_(\d+)): step (\d+)", learner_log)
    k = int(m.group(3))
    assert k % SAVE_EVERY == 0 and KILL_AFTER - SAVE_EVERY < k < STEPS, learner_log[-3000:]

    # The checkpoint held prompts pending (generation runs ahead), and they came back first.
    feed = json.loads((Path(m.group(1)) / "state.json").read_text())["schedule"]["feed"]
    assert feed["pending"] and feed["counters"]["trained"] == k * 8, feed
    killed, resumed = learner_log.split(m.group(0), 1)
    assert f"resumed feed: {len(feed['pending'])} prompt(s) pending" in resumed, resumed[:3000]

    # Every position of the stream trained once (the killed run's steps 1..k, the resumed run's
    # after), or dropped as too stale (--max_staleness: counted, seen in CI on a busy host when a
    # group finished two versions late): none trained twice, none missing unaccounted for.
    before, after = _positions(killed), _positions(resumed)
    assert sorted(before) == list(range(1, max(before) + 1)) and max(before) >= k
    assert sorted(after) == list(range(k + 1, STEPS + 1))
    trained = [p for s in range(1, k + 1) for p in before[s]] + [p for s in after for p in after[s]]
    rows = [r for r in metrics(run) if "rollout/reward" in r]
    stale = rows[-1]["async/dropped_stale"]
    assert len(trained) == len(set(trained)) == STEPS * 8, "a prompt trained twice"
    missing = set(range(max(trained) + 1)) - set(trained)
    assert len(missing) == stale and max(trained) < STEPS * 8 + stale, ("a prompt skipped", sorted(missing), stale)
    assert set(feed["pending"]) <= {p for s in after for p in after[s]} | missing

    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["samples"] == 32 and r["async/max_lag"] <= 1 for r in rows), rows
    assert rows[-1]["async/trained_groups"] == STEPS * 8  # the run's total, across the restart
    # LoRA pushed merged (no adapter on the wire): a step trained on samples of the weights it
    # pushed just before sees vLLM's log-probs equal its own (stale samples differ by design).
    assert learner_log.count("LoRA rank 8 alpha 16") == 2 and " the adapter" not in learner_log
    # rollout/logprob_diff is over those lag-0 samples only (absent in a step that has none)
    diffs = [r["rollout/logprob_diff"] for r in rows if "rollout/logprob_diff" in r]
    assert diffs and min(diffs) < 1e-4, diffs


def test_a_resume_with_another_batch_size_fails_fast_naming_it(tmp_path, tiny_model_dir):
    """No services needed: the check runs before the model loads."""
    from learner.rl import checkpoint as C
    from learner.runtime import checkpoint as R
    from learner.runtime import checkpoint_manifest

    prompts = _prompts(tmp_path)
    ckpt = tmp_path / "ckpt" / "step_00000003"
    ckpt.mkdir(parents=True)
    match = {f: None for f in C.MATCH_FIELDS}
    match.update(pretrain=str(tiny_model_dir), prompt_data=str(prompts), seed=0, rollout_batch_size=8,
                 n_samples_per_prompt=4, train_batch_size=32, micro_train_batch_size=32,
                 advantage_estimator="group_norm", zero_stage=2, world_size=1, n_prompts=100)  # fmt: skip
    (ckpt / "state.json").write_text(json.dumps({"format": R.FORMAT, "step": 3, "match": match}))
    checkpoint_manifest.write_for(ckpt)  # a complete checkpoint, made with other settings
    flags = [f if f != "8" else "16" for f in _learner_flags(prompts)]  # --rollout_batch_size 16
    flags = [f if f != "32" else "64" for f in flags]
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "learner.train_ppo", "--pretrain", str(tiny_model_dir), *flags,
         "--ckpt_path", str(tmp_path / "ckpt"), "--load_checkpoint", "--save_path", str(tmp_path / "out"),
         "--controller_bind", "tcp://127.0.0.1:0"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert res.returncode != 0
    assert "rollout_batch_size: checkpoint 8, this run 16" in res.stderr, res.stderr[-3000:]
    assert "step_00000003" in res.stderr and time.monotonic() - t0 < 120
