"""One ``launch.local`` run for the end-to-end tests: its command, environment, end and metrics.

Every e2e test starts the whole job the way a user does (``python -m launch.local``) on the
tiny model; what differs between them is the learner's flags and a few launcher flags, so those
are the arguments here and the rest is written once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from helpers.paths import HELPERS, ROOT

if TYPE_CHECKING:
    from helpers.shared_fleet import SharedFleet

PARITY_REWARD = f"--reward_func {HELPERS / 'reward_first_char_parity.py'}"
TINY_ROLLOUT_ARGS = "--dtype float32 --max_model_len 128 --enforce_eager --seed 0"
# The agent file the e2e agent runs train with: written for OpenRLHF, used unchanged. The shared
# fleet's rollout servers load it (they serve plain prompts as before).
AGENT_EXAMPLE = ROOT / "examples" / "agents" / "agent_func.py"


def addition_prompts(path: Path) -> Path:
    """300 fixed prompts of the tests' own ("a+b="; not the demo's, which may change)."""
    path.write_text("".join(json.dumps({"input": f"{a}+{b}="}) + "\n" for a in range(30) for b in range(10)))
    return path


def local_cmd(
    run_dir: Path,
    model: Path | str,
    learner: Sequence[str],
    *,
    rollout: str | None = None,
    reward: str | None = PARITY_REWARD,
    extra: Sequence[str] = (),
    fleet: SharedFleet | None = None,
) -> list[str]:
    """``python -m launch.local`` for one run: ``learner`` goes to ``--learner_args``,
    ``rollout``/``reward`` to the services (``rollout=None``: ``TINY_ROLLOUT_ARGS``, or the fleet's;
    ``reward=None``: the launcher's default),
    ``extra`` are launcher flags (``--rollout_servers 2``, ``--restart_learner 1``, ...).
    ``fleet``: the run joins the session's shared services (tests/helpers/shared_fleet.py)
    instead of starting its own, so ``rollout``/``reward`` must be the ones they run."""
    cmd = [sys.executable, "-m", "launch.local", "--run_dir", str(run_dir), "--pretrain", str(model)]
    if fleet is not None:
        assert rollout in (None, fleet.rollout_args), "the shared fleet's rollout servers run other flags"
        assert reward == fleet.reward_args, "the shared fleet's reward service runs other flags"
        assert str(model) == str(fleet.model), "the shared fleet serves another model"
        return [*cmd, "--learner_args", " ".join(learner), *fleet.launcher_flags(), *extra]
    cmd += ["--rollout_args", rollout or TINY_ROLLOUT_ARGS, *(["--reward_args", reward] if reward else [])]
    return [*cmd, "--learner_args", " ".join(learner), "--stop_timeout_s", "15", *extra]


def rewarded_mass(model_dir: Path, prompts: list[str]) -> float:
    """Mean over prompts of the exact probability that the first response token is rewarded
    (its text starts with an even code point), under the model in ``model_dir``. Exact, so
    the assertion carries no sampling noise of its own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = [tok.decode([i]) for i in range(model.config.vocab_size)]
    good = torch.tensor([bool(t) and ord(t[0]) % 2 == 0 for t in texts])
    total = 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
            probs = model(ids).logits[0, -1].softmax(-1)
            total += float(probs[good].sum())
    return total / len(prompts)


def cpu_env(**extra: str) -> dict[str, str]:
    """This environment plus what a multi-process run on 2 cores needs."""
    return dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", **extra)


def start(cmd: list[str], env: dict[str, str] | None = None, *, out: Path | None = None) -> subprocess.Popen:
    """Start the run in its own session (so it can be killed whole); its output to a pipe that
    ``finish`` reads, or to the file ``out``."""
    env = cpu_env() if env is None else env
    if out is None:
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
    with open(out, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for the run and return its output; a run still going after ``timeout`` (a deadlock)
    is stopped and the test fails with its tail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"run did not finish within {timeout:.0f} s:\n{(out or '')[-4000:]}")
    return out or ""


def metrics(run: Path) -> list[dict]:
    """The run's metrics rows so far (a line still being written is skipped)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


# ---------------------------------------------------------------------------- async runs

ASYNC_K = 1  # --max_staleness of the async e2e runs


def async_rows(run: Path) -> list[dict]:
    """The async schedule's step rows so far."""
    return [m for m in metrics(run) if "async/admitted" in m]


def check_async_steps_and_accounting(rows: list[dict], steps: int, b: int, g: int, k: int = ASYNC_K) -> None:
    """Every step trained a full batch (B groups of G) within the bound K, and each step the feed's
    identity held: admitted = trained + dropped (stale, failed, filtered) + aborted + outstanding."""
    assert [m["step"] for m in rows] == list(range(1, steps + 1)), [m.get("step") for m in rows]
    for m in rows:
        assert m["samples"] == b * g and 0 <= m["async/max_lag"] <= k, m
        assert m["async/trained_groups"] == m["step"] * b, m
        ended = (
            m["async/trained_groups"]
            + m["async/dropped_stale"]
            + m["async/dropped_failed"]
            + m.get("filter/groups_filtered", 0)
            + m["async/aborted"]
        )
        assert m["async/admitted"] == ended + m["async/outstanding"], m
