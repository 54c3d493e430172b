"""One metrics writer for every trainer: a JSON-lines file and, optionally, TensorBoard and
Weights & Biases (``learner.runtime.wandb_sink``).

Each record is one line ``{"step": N, "time": UNIX_S, "<prefix>/<key>": value, ...}``. The
caller picks the file: RL writes ``metrics.jsonl`` (read by ``launch.local``'s progress line),
the supervised trainers ``train_log.jsonl``. TensorBoard gets the numeric values of each record,
wandb the whole record. Generated samples (``write_samples``) go to ``samples.jsonl`` beside the
file and to a wandb table. Only rank 0 should build one; the writer does not check, so it needs
no process group and tests drive it directly.

The file is opened per record, not held: a record is written at most once per optimizer step,
and a crash or a reader (the progress line, a test) never sees a half-buffered line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("rayless.metrics")

SAMPLES_FILE = "samples.jsonl"
SAMPLES_TABLE = "generated_samples"  # the wandb key of the samples table (OpenRLHF's name)


class MetricsWriter:
    """``write(step, metrics, prefix)`` appends one JSON line and logs numeric values to TensorBoard.

    Args:
        path: the JSON-lines file; its folder is created, the file appended to (a resumed run
            continues it).
        tensorboard_dir: a ``SummaryWriter`` log dir; None or "" for no TensorBoard. When
            TensorBoard cannot be opened (not installed), a warning says so and the run goes on.
        wandb: a ``learner.runtime.wandb_sink.WandbSink`` (None: no wandb); it starts at the
            first record and, if it cannot, says so once and stops.
    """

    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None, wandb: Any = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()  # exists from the start, so a reader can tell "no step yet" from "no run"
        self.samples_path = self.path.with_name(SAMPLES_FILE)
        self.tensorboard_dir = str(tensorboard_dir) if tensorboard_dir else None
        self.tb = None
        self.last_step = 0  # the highest step written (a checkpoint's TensorBoard purge point)
        self.wandb = wandb
        self._open_tensorboard()

    def _open_tensorboard(self, purge_step: int | None = None) -> None:
        if not self.tensorboard_dir:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(self.tensorboard_dir, purge_step=purge_step)
        except Exception as e:  # noqa: BLE001 - TensorBoard is optional; say so once
            log.warning("TensorBoard disabled: %s", e)

    def resume_after(self, step: int) -> None:
        """A run resumed from a checkpoint at ``step``: TensorBoard hides the killed run's events
        from ``step + 1`` on (its ``purge_step``), since the resumed run writes those steps again,
        and the samples file drops its records after ``step``."""
        self.last_step = step
        if self.tb is not None:
            self.tb.close()
            self._open_tensorboard(purge_step=step + 1)
        trim_jsonl(self.samples_path, step)

    # ---- a checkpoint part (learner.runtime.checkpoint): where the file stood at the save, and
    # the tracked run (wandb's run id), which a resumed run continues
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"bytes": self.path.stat().st_size, "step": self.last_step}
        if self.wandb is not None:
            state["wandb"] = self.wandb.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Drops what the killed run wrote after the checkpoint (the resumed run writes those
        steps again; a line the kill cut goes too) by cutting the file back to its length at the
        save, and hides the same steps' events from TensorBoard. A file shorter than that is
        another file (a new --save_path or --metrics_file) and is left as it is. Called before
        the resumed run's first record, so wandb continues the saved run."""
        if self.wandb is not None:
            self.wandb.load_state_dict(state.get("wandb", {}))
        size, keep = self.path.stat().st_size, int(state["bytes"])
        if size > keep:
            with self.path.open("rb+") as fh:
                fh.seek(keep)
                dropped = fh.read().count(b"\n")
                fh.truncate(keep)
            log.info("%s: dropped %d record(s) written after the checkpoint (they are done again)", self.path, dropped)
        elif size < keep:
            log.info("%s is shorter than at the checkpoint (%d < %d bytes): a new file, kept", self.path, size, keep)
        self.resume_after(int(state["step"]))

    def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> None:
        """Appends ``metrics``, keys as ``prefix/key`` when a prefix is given."""
        named = {f"{prefix}/{k}" if prefix else k: v for k, v in metrics.items()}
        record = {"step": step, "time": time.time(), **named}
        self.last_step = max(self.last_step, step)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in named.items():
                if isinstance(v, (int, float)):  # strings and lists go to the file only
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(record)

    def write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Generated samples (dicts with the same keys: prompt, response, reward, ...): one line
        each in ``samples.jsonl``, with the step, and one wandb table per call."""
        if not rows:
            return
        with self.samples_path.open("a") as fh:
            for row in rows:
                fh.write(json.dumps({"step": step, **row}) + "\n")
        if self.wandb is not None:
            columns = ["step", *rows[0]]
            self.wandb.table(step, SAMPLES_TABLE, columns, [[step, *(r.get(c) for c in columns[1:])] for r in rows])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.close()


def trim_jsonl(path: Path, step: int) -> int:
    """Drops records after ``step`` from a JSON-lines file of ``{"step": ...}`` records (the
    killed run's steps that a resumed run does again), atomically; a line cut by a kill goes
    too. Returns how many were dropped."""
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            rec_step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if rec_step > step:
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".trim")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return dropped
