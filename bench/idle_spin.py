"""vLLM's idle spin under ``launch.local --cpu_cores phases``: a lockstep step per spin, in one invocation.

After each generation vLLM's CPU worker keeps polling for the next step on a core for 1 s
(its ``SpinCondition`` default) before it sleeps. In lockstep that second falls in the
learner's phase; under ``--cpu_cores phases`` the learner trains on every core, so it loses
one of them for up to a second a step. ``rollout_service --idle_spin_s`` shortens the spin
(``launch.local --cpu_cores phases`` sets 0.05 s); this bench measures what that is worth.

Each run is ``launch.local`` on the tiny model (``common.tiny``): one rollout server, one
reward service, one learner rank, lockstep GRPO with 16 prompts x 8 samples of 6 new tokens
per step. Variants (``--variants NAME:SPIN:CORES``: ``SPIN`` the rollout server's
``--idle_spin_s`` in seconds, 1 being vLLM's own, or ``-`` for none given, i.e. launch.local's
choice: 0.05 under ``phases``, vLLM's own under ``split``; ``CORES`` a ``--cpu_cores`` value) run in turn, ``--rounds`` times, alternating (this host is
shared and drifts). Per variant: median s/step (and its generate / train / push parts) over
the steps after ``--warmup`` of every round.

Run::

    python bench/idle_spin.py                      # phases with vLLM's 1 s spin, phases with 0.05 s, split (1 s)
    python bench/idle_spin.py --steps 30 --rounds 1
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

REPO = prepare(tests=True)

from common.vllm_spin import IDLE_SPIN_ENV
from helpers.e2e_launch import addition_prompts, local_cmd  # after prepare()


def learner_args(prompts: Path, steps: int) -> list[str]:
    return grpo_learner_args(
        prompts,
        group=8,
        prompts_per_step=16,
        micro=128,
        micro_rollout=16,
        steps=steps,
        max_len=6,
        lr=5e-4,
        num_episodes=100,
        peer_timeout_s=60,
    )


def run_variant(args, model: Path, prompts: Path, work: Path, name: str, spin: str, cores: str, rnd: int) -> list:
    run_dir = work / f"{name}-{rnd}"
    rollout = "--dtype float32 --max_model_len 256 --seed 0" + ("" if spin == "-" else f" --idle_spin_s {spin}")
    cmd = local_cmd(run_dir, model, learner_args(prompts, args.steps), rollout=rollout, extra=["--cpu_cores", cores])
    cmd.append("--quiet")
    env = dict(os.environ, **CPU_ENV)
    env.pop(IDLE_SPIN_ENV, None)  # the variant says the spin; launch.local's phases default otherwise
    seen = run_stamped(cmd, run_dir, env=env, label=name)
    rows = [m for _, m in seen if "time/step_s" in m][args.warmup :]
    if not rows:
        raise SystemExit(f"{name}: no step after --warmup {args.warmup} (--steps {args.steps})")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["phases-1s:1:phases", "phases-0.05s:0.05:phases", "split-1s:-:split"],
        help="NAME:SPIN:CORES each (SPIN: --idle_spin_s seconds, 1 = vLLM's own; - = launch.local's choice)",
    )
    p.add_argument("--steps", type=int, default=40, help="lockstep steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps of each run not counted")
    p.add_argument("--rounds", type=int, default=2, help="runs per variant, alternated")
    p.add_argument("--work_dir", default="", help="where runs go (default: a temporary directory)")
    args = p.parse_args()
    variants = []
    for v in args.variants:
        parts = v.split(":")
        if len(parts) != 3 or parts[2] not in ("phases", "split", "auto"):
            raise SystemExit(f"--variants {v!r}: expected NAME:SPIN:CORES, CORES one of phases, split, auto")
        if parts[1] != "-":
            try:
                if float(parts[1]) < 0:
                    raise ValueError
            except ValueError:
                raise SystemExit(f"--variants {v!r}: SPIN must be seconds >= 0 or -") from None
        variants.append(parts)

    from common.tiny import build_tiny_model

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="idle-spin-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(work / "tiny")
    prompts = addition_prompts(work / "prompts.jsonl")
    rows: dict[str, list[dict]] = {name: [] for name, *_ in variants}
    for rnd in range(args.rounds):
        for name, spin, cores in variants:
            got = run_variant(args, model, prompts, work, name, spin, cores, rnd)
            rows[name] += got
            print(f"{name:16} round {rnd}: {statistics.median(m['time/step_s'] for m in got):.3f} s/step", flush=True)
    med = statistics.median
    summary = {}
    print(f"{'variant':16}{'s/step':>9}{'generate':>10}{'train':>8}{'push':>8}{'steps':>7}")
    for name, rs in rows.items():
        s = {
            "s_per_step": med(m["time/step_s"] for m in rs),
            "generate_s": med(m["time/generate_s"] for m in rs),
            "train_s": med(m["time/train_s"] for m in rs),
            "push_s": med(m["time/step_s"] - m["time/generate_s"] - m["time/train_s"] for m in rs),
            "steps": len(rs),
        }
        summary[name] = s
        print(
            f"{name:16}{s['s_per_step']:>9.3f}{s['generate_s']:>10.3f}{s['train_s']:>8.3f}{s['push_s']:>8.3f}{len(rs):>7}"
        )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
