"""Experiment tracking flags every trainer shares (``train_ppo``, ``train_sft``, ``train_rm``,
``train_dpo``), and how a secret in them is kept out of every log.

OpenRLHF's names and meanings: ``--use_wandb`` turns Weights & Biases on, given either the API
key itself or a true value (``True``, ``1``, ``yes``) when the key is elsewhere (``WANDB_API_KEY``,
``wandb login``, or no key at all with ``WANDB_MODE=offline``). ``--wandb_org`` (entity),
``--wandb_group``, ``--wandb_project`` and ``--wandb_run_name`` say where the run goes. The
sink itself is ``learner.runtime.wandb_sink.WandbSink``, one more sink of ``MetricsWriter``.

A key given on the command line is held as a ``Secret``: its ``repr``/``str`` (what a dataclass
repr, ``common.config.to_json`` and so the logged config print) is ``<redacted>``, and only
``reveal()`` gives the key, to wandb. ``redact_argv`` hides it in a command line (launch.local's
logs print each role's command). Imports nothing heavy: the configs that use it answer
``--help`` at once.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.config import flag, section

REDACTED = "<redacted>"
# --use_wandb values that mean "on, the key is elsewhere" and "off" (OpenRLHF reads any
# non-empty string as on, so `--use_wandb False` would log with the key "False"; here it is off).
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off", "none"}


class Secret:
    """A string that prints as ``<redacted>`` wherever it ends up; ``reveal()`` is the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return repr(REDACTED)

    def __str__(self) -> str:
        return REDACTED

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __deepcopy__(self, memo: dict) -> Secret:  # dataclasses.asdict deep-copies field values
        return self


@dataclass
class WandbSection:
    """Weights & Biases (OpenRLHF's ``logger.wandb.*``). The metrics go there besides metrics.jsonl and TensorBoard."""

    key: str = flag(
        "",
        "log to Weights & Biases (rank 0): the API key, or True when the key is in WANDB_API_KEY / wandb login "
        "(or none is needed: WANDB_MODE=offline); the key is never logged. A failed start warns and the run "
        "goes on with its other sinks",
        flat="use_wandb",
    )
    org: str = flag("", "wandb entity (team or user); empty: the key's default entity", flat="wandb_org")
    group: str = flag("", "wandb run group", flat="wandb_group")
    project: str = flag("", "wandb project (empty: rayless_<trainer>, e.g. rayless_train_ppo)", flat="wandb_project")
    run_name: str = flag("", "wandb run name (empty: <trainer>_MMDDTHH:MM, as OpenRLHF)", flat="wandb_run_name")

    def __post_init__(self) -> None:
        """The key: off, on, or on with a key (held as a ``Secret`` from here on)."""
        value = self.key
        if isinstance(value, Secret):  # already checked (dataclasses.replace re-runs __post_init__)
            return
        value = str(value).strip()
        if value.lower() in _FALSE:
            self.key = ""
        elif value.lower() in _TRUE:
            self.key = "True"
        else:
            self.key = Secret(value)  # type: ignore[assignment]  # a str that does not print

    @property
    def enabled(self) -> bool:
        return bool(self.key)

    def api_key(self) -> str | None:
        """The API key given with ``--logger.wandb.key`` (None: on without one, or off)."""
        return self.key.reveal() if isinstance(self.key, Secret) else None

    def names(self, trainer: str) -> tuple[str, str]:
        """(project, run name) with the defaults filled in; ``trainer``: ``train_ppo``, ``train_sft``, ..."""
        short = trainer.removeprefix("train_")
        project = self.project or f"rayless_{trainer}"
        name = self.run_name or f"{short}_{datetime.datetime.now():%m%dT%H:%M}"
        return project, name


@dataclass
class LoggerSection:
    """Where metrics go (OpenRLHF's ``logger.*``; docs/tracking.md)."""

    logging_steps: int = flag(1, "log every N steps", flat="logging_steps")
    tensorboard_dir: str = flag("", "TensorBoard log dir (empty: off)", flat="use_tensorboard")
    wandb: WandbSection = section(WandbSection, "Weights & Biases")

    def __post_init__(self) -> None:
        if self.logging_steps < 1:
            raise ValueError(f"--logger.logging_steps (--logging_steps) must be >= 1, got {self.logging_steps}")


def public_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as JSON-able values with secrets redacted: what a tracker may record."""
    import json

    from common.config import to_json

    return json.loads(to_json(cfg))  # to_json prints a Secret as <redacted>


_KEY_FLAGS = ("--use_wandb", "--logger.wandb.key")  # both spellings of the key's flag


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the key after ``--use_wandb`` (or in ``--use_wandb=KEY``) replaced by
    ``<redacted>``; on/off values are kept, they say what the run does."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append(arg if arg.strip().lower() in _TRUE | _FALSE else REDACTED)
            hide_next = False
        elif arg in _KEY_FLAGS:
            out.append(arg)
            hide_next = True
        elif arg.split("=", 1)[0] in _KEY_FLAGS and "=" in arg:
            name, value = arg.split("=", 1)
            out.append(arg if value.strip().lower() in _TRUE | _FALSE else f"{name}={REDACTED}")
        else:
            out.append(arg)
    return out
