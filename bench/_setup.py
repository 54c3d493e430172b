"""What the bench scripts share: the repository on ``sys.path``, a CPU run's environment, and
one ``launch.local`` run watched step by step.

Each script is run as ``python bench/NAME.py`` (so ``bench/`` is first on ``sys.path`` and
``import _setup`` finds this file) and calls ``prepare()`` before importing the project.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A multi-process run on few cores: one OpenMP thread per process (contention once made
# generation 26x slower), a small vLLM KV cache, nothing fetched from the hub.
CPU_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}


def prepare(*, tests: bool = False) -> Path:
    """Put the repository (and ``tests/``, for the test helpers) on ``sys.path`` and default the
    CPU environment in ``os.environ`` (a value the caller set wins); returns the repository."""
    for p in [REPO, *([REPO / "tests"] if tests else [])]:
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    return REPO


def grpo_learner_args(
    prompts: Path,
    *,
    group: int,
    prompts_per_step: int,
    micro: int,
    micro_rollout: int,
    steps: int,
    max_len: int,
    lr: float,
    **flags: object,
) -> list[str]:
    """``learner.train_ppo`` flags of a bench's lockstep GRPO job (``--learner_args`` of
    ``launch.local``): one optimizer step of ``prompts_per_step x group`` samples per rollout,
    ZeRO-2, no KL, seed 0; ``flags`` add or override (``label_key="label"``)."""
    args: dict[str, object] = {
        "prompt_data": prompts,
        "input_key": "input",
        "advantage_estimator": "group_norm",
        "n_samples_per_prompt": group,
        "rollout_batch_size": prompts_per_step,
        "train_batch_size": prompts_per_step * group,
        "micro_train_batch_size": micro,
        "micro_rollout_batch_size": micro_rollout,
        "max_steps": steps,
        "generate_max_len": max_len,
        "actor_learning_rate": lr,
        "zero_stage": 2,
        "init_kl_coef": 0.0,
        "seed": 0,
        **flags,
    }
    return [x for name, value in args.items() for x in (f"--{name}", str(value))]


def run_stamped(
    cmd: list[str], run_dir: Path, *, env: dict[str, str], label: str, poll_s: float = 0.02
) -> list[tuple[float, dict]]:
    """Run ``cmd`` (a ``launch.local`` command writing ``run_dir``) and stamp each metrics row
    with ``time.monotonic()`` as it appears; returns ``[(time, row), ...]``.

    The child's output goes to ``run_dir/bench-launch.log`` (a pipe read only at exit would
    fill and hang a chatty run); a failing run raises SystemExit with the log's tail.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path, metrics = run_dir / "bench-launch.log", run_dir / "metrics.jsonl"
    seen: list[tuple[float, dict]] = []

    def take() -> None:
        if metrics.exists():
            text = metrics.read_text()
            text = text[: text.rfind("\n") + 1]  # whole lines only: the writer may be mid-line
            lines = [x for x in text.splitlines() if x.strip()]
            seen.extend((time.monotonic(), json.loads(x)) for x in lines[len(seen) :])

    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            take()  # polled every poll_s: small against a step of seconds
            time.sleep(poll_s)
    take()
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed ({proc.returncode}); {log_path}:\n{log_path.read_text()[-3000:]}")
    return seen
