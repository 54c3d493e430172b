"""Weights & Biases as one sink of ``MetricsWriter`` (rank 0): what goes to the JSON-lines file goes here.

Each record of the file, ``{"step": N, "time": ..., key: value, ...}``, is one ``run.log`` of the
same dict. The run's x axis is that ``step`` (``define_metric("*", step_metric="step")``), not
wandb's own call counter: a training step's metrics and the evaluation written at the same step
line up in every chart, and the supervised trainers' ``train/*`` and ``eval/*`` do too.

- **Start**: at the first record, not when the writer is built, so that a resumed run knows its
  run id first (``load_state_dict``, from the checkpoint) and continues that run
  (``wandb.init(id=..., resume="allow")``; offline, a second offline run folder with the same id,
  which ``wandb sync`` appends). The run's config is the trainer's, secrets redacted
  (``learner.runtime.tracking.public_config``); wandb's record of the command line gets the same
  treatment (``redact_argv``: a key passed as ``--use_wandb KEY`` is in ``sys.argv``).
- **Failure**: a start that fails (no network, a bad key, wandb missing) or a log that raises
  is said once, as a warning, and the sink stops; the run goes on with its other sinks.
- A resumed run logs the steps after its checkpoint again; wandb keeps the killed run's points
  for them too (TensorBoard hides those, ``MetricsWriter.resume_after``; wandb's rewind needs
  its server). Offline, wandb writes its run file in blocks: a learner killed -9 with its
  process group loses the records of the last block (metrics.jsonl and TensorBoard have them).

``WANDB_MODE=offline`` runs it without a network (the tests do); ``WANDB_DIR`` moves its folder
(default: beside the metrics file).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from learner.runtime.tracking import REDACTED, WandbSection, redact_argv

log = logging.getLogger("rayless.metrics")

STEP_KEY = "step"  # the x axis of every chart: the record's step


def wandb_sink(flags: WandbSection, *, trainer: str, config: Mapping[str, Any], folder: str | Path) -> WandbSink | None:
    """The sink the ``logger.wandb`` section asks for (``--logger.wandb.key`` / ``--use_wandb``), or
    None; ``config``: the run's whole config, secrets redacted (``tracking.public_config``)."""
    if not flags.enabled:
        return None
    return WandbSink(flags, trainer=trainer, config=config, folder=folder)


class WandbSink:
    """``log(record)`` per metrics record, ``table(...)`` for generated samples; ``close()`` finishes the run.

    Args:
        flags: the trainer's ``logger.wandb`` section.
        trainer: ``train_ppo``, ``train_sft``, ...: the default project and run name.
        config: what the run records as its config (secrets already redacted).
        folder: where wandb writes its ``wandb/`` folder unless ``WANDB_DIR`` says otherwise.
    """

    def __init__(self, flags: WandbSection, *, trainer: str, config: Mapping[str, Any], folder: str | Path) -> None:
        self.flags = flags
        self.trainer = trainer
        self.config = dict(config)
        self.folder = Path(folder)
        self.run_id: str | None = None  # the run to continue (a resume), then the run's own
        self.run: Any = None
        self.failed = False

    # ------------------------------------------------------------------ state (checkpoints)
    def state_dict(self) -> dict[str, Any]:
        return {"wandb_run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Before the first record: continue the run the checkpoint names."""
        if state.get("wandb_run_id") and self.run is None:
            self.run_id = str(state["wandb_run_id"])

    # ------------------------------------------------------------------ the sink
    def _start(self) -> bool:
        if self.run is not None:
            return True
        if self.failed:
            return False
        key = self.flags.api_key()
        try:
            import wandb

            project, name = self.flags.names(self.trainer)
            folder = Path(os.environ.get("WANDB_DIR") or self.folder)
            folder.mkdir(parents=True, exist_ok=True)
            settings = wandb.Settings(api_key=key) if key else None  # a session key: nothing written to ~/.netrc
            with _redacted_argv():
                run = wandb.init(
                    entity=self.flags.org or None,
                    project=project,
                    group=self.flags.group or None,
                    name=name,
                    id=self.run_id,
                    resume="allow" if self.run_id else None,
                    config=self.config,
                    dir=str(folder),
                    settings=settings,
                )
            run.define_metric(STEP_KEY)
            run.define_metric("*", step_metric=STEP_KEY, step_sync=True)
        except Exception as e:  # noqa: BLE001 - any failure of an optional sink: say it once, go on
            self._fail("could not start", e, key)
            return False
        continued = self.run_id is not None  # offline, wandb itself cannot tell (run.resumed is False)
        self.run, self.run_id = run, run.id
        where = getattr(run, "url", None) or f"offline, in {folder}"
        log.info("wandb: run %s %s (%s)", run.id, "continued" if continued else "started", where)
        return True

    def log(self, record: Mapping[str, Any]) -> None:
        """One metrics record (its ``step`` is the x axis)."""
        if not self._start():
            return
        try:
            self.run.log(dict(record))
        except Exception as e:  # noqa: BLE001 - see _fail
            self._fail("failed to log", e, self.flags.api_key())

    def table(self, step: int, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A ``wandb.Table`` of ``rows`` under ``key`` at ``step`` (generated samples)."""
        if not self._start():
            return
        try:
            import wandb

            self.run.log({STEP_KEY: step, key: wandb.Table(columns=list(columns), data=[list(r) for r in rows])})
        except Exception as e:  # noqa: BLE001 - see _fail
            self._fail("failed to log a table", e, self.flags.api_key())

    def _fail(self, what: str, e: BaseException, key: str | None) -> None:
        message = f"{type(e).__name__}: {e}"
        if key:
            message = message.replace(key, REDACTED)
        log.warning(
            "wandb %s (%s); wandb is off for the rest of this run, the metrics still go to the other sinks",
            what,
            message,
        )
        self.failed = True
        if self.run is not None:
            with contextlib.suppress(Exception):
                self.run.finish(exit_code=1)
            self.run = None

    def close(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as e:  # noqa: BLE001 - the run's own results are written already
                log.warning("wandb: finishing the run failed: %s", e)
            self.run = None


@contextlib.contextmanager
def _redacted_argv() -> Iterator[None]:
    """wandb records ``sys.argv`` in the run's metadata while it starts; a key given as
    ``--use_wandb KEY`` must not be in it."""
    saved = sys.argv
    sys.argv = redact_argv(saved)
    try:
        yield
    finally:
        sys.argv = saved
