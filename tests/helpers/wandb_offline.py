"""wandb in offline mode for the tests, and its runs read back with wandb's own reader.

``offline_env(folder)`` is the environment that keeps every file wandb writes (runs, cache,
config, artifact staging) under ``folder`` and never touches the network. A finished offline
run is a ``.wandb`` transaction log; ``records(path)`` reads it with ``wandb leet inspect --json``
(wandb's reader of that format, one JSON record per line), so the tests check what wandb itself
stored, not what the code meant to send.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


def offline_env(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CACHE_DIR": str(folder / "cache"),
        "WANDB_CONFIG_DIR": str(folder / "config"),
        "WANDB_DATA_DIR": str(folder / "data"),
    }


def offline_runs(wandb_dir: Path) -> list[Path]:
    """The ``.wandb`` files of the offline runs under ``wandb_dir`` (the folder holding ``wandb/``),
    oldest first (their folders are named by start time)."""
    return sorted((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def records(path: Path) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def history(recs: list[dict]) -> list[dict]:
    """The run's history rows (one per ``run.log``), as logged."""
    return [r["history"]["item"] for r in recs if r.get("type") == "history"]


def run_info(recs: list[dict]) -> dict:
    """The run record: its id, name, project, config."""
    return next(r["run"] for r in recs if r.get("type") == "run")


def same(logged: object, stored: object) -> bool:
    """A value as metrics.jsonl has it against the same value as wandb stored it (its JSON
    writes NaN and infinities as the strings "NaN", "Infinity", "-Infinity")."""
    if isinstance(logged, float) and not math.isfinite(logged):
        return stored == ("NaN" if math.isnan(logged) else "Infinity" if logged > 0 else "-Infinity")
    return logged == stored


def missing_from_history(metrics: list[dict], rows: list[dict]) -> list[tuple[int, str]]:
    """(step, key) of every value in the metrics.jsonl records that no history row holds at
    that step with that value (the time stamp included: the record is logged whole)."""
    missing = []
    for rec in metrics:
        for key, value in rec.items():
            if key == "step":
                continue
            if not any(r.get("step") == rec["step"] and same(value, r.get(key)) for r in rows):
                missing.append((rec["step"], key))
    return missing
