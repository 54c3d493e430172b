"""One metrics writer for every trainer: a JSON-lines file and, optionally, TensorBoard.

Each record is one line ``{"step": N, "time": UNIX_S, "<prefix>/<key>": value, ...}``. The
caller picks the file: RL writes ``metrics.jsonl`` (read by ``launch.local``'s progress line),
the supervised trainers ``train_log.jsonl``. Only rank 0 should build one; the writer does not
check, so it needs no process group and tests drive it directly.

The file is opened per record, not held: a record is written at most once per optimizer step,
and a crash or a reader (the progress line, a test) never sees a half-buffered line.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("rayless.metrics")


class MetricsWriter:
    """``write(step, metrics, prefix)`` appends one JSON line and logs numeric values to TensorBoard.

    Args:
        path: the JSON-lines file; its folder is created, the file appended to (a resumed run
            continues it).
        tensorboard_dir: a ``SummaryWriter`` log dir; None or "" for no TensorBoard. When
            TensorBoard cannot be opened (not installed), a warning says so and the run goes on.
    """

    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()  # exists from the start, so a reader can tell "no step yet" from "no run"
        self.tensorboard_dir = str(tensorboard_dir) if tensorboard_dir else None
        self.tb = None
        self.last_step = 0  # the highest step written (a checkpoint's TensorBoard purge point)
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
        from ``step + 1`` on (its ``purge_step``), since the resumed run writes those steps again."""
        self.last_step = step
        if self.tb is not None:
            self.tb.close()
            self._open_tensorboard(purge_step=step + 1)

    # ---- a checkpoint part (learner.runtime.checkpoint): where the file stood at the save
    def state_dict(self) -> dict[str, Any]:
        return {"bytes": self.path.stat().st_size, "step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Drops what the killed run wrote after the checkpoint (the resumed run writes those
        steps again; a line the kill cut goes too) by cutting the file back to its length at the
        save, and hides the same steps' events from TensorBoard. A file shorter than that is
        another file (a new --save_path or --metrics_file) and is left as it is."""
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

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
