"""Lockstep vs async (``--async_train``): samples/s of the same run config, in one invocation.

Each run is ``launch.local`` with the tiny model (``common.tiny``), one rollout server, one
reward service and one learner rank, one thread per process in both schedules. The only
difference between the two runs of a pair is ``--async_train`` (``--max_staleness 1``).

Phases are tuned by work, not by sleeping (lockstep has no sleep knob, and a sleep in one
schedule only would not be the same config): generation by ``--generate_max_len``, training
by ``--max_epochs`` (passes over each batch, one optimizer step each). A short lockstep
calibration run measures the generation and per-epoch training time, then two pairs run:

- ``equal``: epochs chosen so that training takes about the generation time;
- ``gen2x``: epochs chosen so that generation takes about twice the training time.

samples/s is counted from the learner's metrics file, stamped by this process as each step's
row appears, over the steps after ``--warmup`` (start-up, vLLM's first batches and DeepSpeed's
first step excluded). Ideal ratios: just under 2 (equal) and 1.5 (gen2x); the issue's goals are
1.6 and 1.3. On a host where the roles share a few cores (CI: 2), overlapping generation and
training also makes them compete for the same cores, so the ratio measures that contention as
much as the schedule: it is a lower bound for a cluster where each role has its own devices.

Run: ``python bench/schedules.py [--steps 8] [--warmup 2] [--generate_max_len 48]``
(prints one line per run and a JSON summary line last).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _setup import CPU_ENV, grpo_learner_args, prepare, run_stamped

REPO = prepare()
ENV = dict(os.environ, **CPU_ENV)


def run_once(args, model: Path, work: Path, name: str, *, async_train: bool, epochs: int, steps: int) -> dict:
    """One launch.local run; returns its rows with arrival times and samples/s after warm-up."""
    run_dir = work / name
    prompts = work / "prompts.jsonl"
    learner = grpo_learner_args(
        prompts,
        group=args.g,
        prompts_per_step=args.b,
        micro=args.b * args.g,
        micro_rollout=args.b * args.g,
        steps=steps,
        max_len=args.generate_max_len,
        lr=1e-3,
        max_epochs=epochs,
    )
    if async_train:
        # Same loss in both: async's default IS correction is turned off so that only the
        # schedule differs (the correction costs a few element-wise ops).
        learner += ["--async_train", "--max_staleness", "1", "--is_correction", "none"]
    cmd = [
        *(sys.executable, "-m", "launch.local", "--run_dir", str(run_dir), "--pretrain", str(model), "--quiet"),
        *("--rollout_args", "--dtype float32 --max_model_len 256 --enforce_eager --seed 0"),
        *("--reward_args", f"--reward_func {REPO / 'tests' / 'helpers' / 'reward_first_char_parity.py'}"),
        *("--learner_args", " ".join(learner), "--stop_timeout_s", "15"),
    ]
    seen = run_stamped(cmd, run_dir, env=ENV, label=name, poll_s=0.01)
    rows = [(t, m) for t, m in seen if "samples" in m and "step" in m]
    if len(rows) < args.warmup + 2:
        raise SystemExit(f"{name}: only {len(rows)} step rows stamped (steps too short to watch?)")
    t0 = rows[args.warmup - 1][0]
    timed = rows[args.warmup :]
    samples = sum(m["samples"] for _, m in timed)
    res = {
        "name": name,
        "epochs": epochs,
        "samples_per_s": samples / (timed[-1][0] - t0),
        "generate_s": statistics.median(m.get("time/generate_s", 0.0) for _, m in timed),
        "train_s": statistics.median(m.get("time/train_s", 0.0) for _, m in timed),
    }
    if async_train:
        res["learner_idle_frac"] = statistics.mean(m["async/learner_idle_frac"] for _, m in timed)
        res["rollout_idle_frac"] = statistics.mean(m["async/rollout_idle_frac"] for _, m in timed)
        res["mean_lag"] = sum(m.get("async/lag_1", 0) for _, m in timed) / samples
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    p.add_argument("--b", type=int, default=16, help="prompts per step")
    p.add_argument("--g", type=int, default=4, help="samples per prompt")
    p.add_argument("--generate_max_len", type=int, default=48, help="tokens per answer (the generation time)")
    p.add_argument("--work_dir", default="", help="where runs go (default: a temporary folder)")
    args = p.parse_args()

    from common.tiny import build_tiny_model

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rayless-bench-schedules-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(work / "tiny")
    (work / "prompts.jsonl").write_text(
        "".join(json.dumps({"input": f"{a}+{c}="}) + "\n" for a in range(50) for c in range(10))
    )
    # Calibration: lockstep, one epoch: generation time and training time per epoch.
    cal = run_once(args, model, work, "calibrate", async_train=False, epochs=1, steps=args.warmup + 3)
    gen, train1 = cal["generate_s"], max(cal["train_s"], 1e-3)
    print(f"calibration: generation {gen:.2f} s, training {train1:.2f} s per epoch", flush=True)
    summary = {"command": " ".join(["python", "bench/schedules.py", *sys.argv[1:]]), "calibration": cal}
    for case, target in (("equal", gen), ("gen2x", gen / 2)):
        epochs = max(1, round(target / train1))
        lock = run_once(args, model, work, f"{case}-lockstep", async_train=False, epochs=epochs, steps=args.steps)
        asy = run_once(args, model, work, f"{case}-async", async_train=True, epochs=epochs, steps=args.steps)
        ratio = asy["samples_per_s"] / lock["samples_per_s"]
        print(
            f"{case}: epochs {epochs}; lockstep {lock['samples_per_s']:.1f} samples/s "
            f"(generate {lock['generate_s']:.2f} s, train {lock['train_s']:.2f} s per step), "
            f"async {asy['samples_per_s']:.1f} samples/s; async / lockstep = {ratio:.2f}",
            flush=True,
        )
        summary[case] = {"lockstep": lock, "async": asy, "ratio": ratio}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
