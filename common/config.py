"""Dataclass configs generated into argparse: one field, one flag, one line of help.

Every entry point declares its flags as a dataclass whose fields carry ``help`` metadata::

    @dataclass
    class Config:
        lr: float = flag(1e-6, "learning rate")
        prompt_data: str = flag("", "dataset path or hub name", required=True)

``parse(Config, argv)`` builds the parser (``--lr``; booleans become ``--flag`` / ``--no-flag``),
optionally layers a YAML file given with ``--config``, validates, and returns the instance.
This module imports nothing heavy, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """Flags that do not parse or validate, for a caller that parses another program's flags
    (``parse(..., raise_errors=True)``) and words the error itself; the message names the flag."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigError(message)


def flag(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    required: bool = False,
    choices: Sequence[Any] | None = None,
    aliases: Sequence[str] = (),
    group: str = "",
) -> Any:
    meta = {"help": help, "required": required, "choices": choices, "aliases": tuple(aliases), "group": group}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(element type, is_list) of an annotation like ``int``, ``float | None``, ``list[str]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (str,)
        return inner, True
    return tp, False


def build_parser(
    cls: type, description: str = "", prog: str | None = None, *, raise_errors: bool = False
) -> argparse.ArgumentParser:
    parser_class = _RaisingParser if raise_errors else argparse.ArgumentParser
    parser = parser_class(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file of flag values; command-line flags override it")
    groups: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        group = meta.get("group") or ""
        target = parser if not group else groups.setdefault(group, parser.add_argument_group(group))
        names = [f"--{f.name}", *meta.get("aliases", ())]
        tp, is_list = _base_type(hints[f.name])
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        help_text = meta.get("help", "") or " "
        if tp is bool and not is_list:
            target.add_argument(
                *names,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=f"{help_text} (default: {default})",
            )
            continue
        kwargs: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=f"{help_text} (default: {default})")
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if is_list:
            kwargs.update(nargs="+", type=tp)
        elif tp in (int, float, str):
            kwargs["type"] = tp
        target.add_argument(*names, **kwargs)
    return parser


def parse(
    cls: type[T],
    argv: Sequence[str] | None = None,
    description: str = "",
    prog: str | None = None,
    *,
    raise_errors: bool = False,
) -> T:
    """``cls`` from ``argv``. A bad flag prints the usage and exits 2, as argparse does; with
    ``raise_errors`` it raises ConfigError instead (nothing printed)."""
    parser = build_parser(cls, description, prog, raise_errors=raise_errors)
    ns = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    path = ns.pop("config", None)
    if path:
        values.update(load_yaml(path, cls, parser))
    values.update(ns)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # cls is a dataclass type
    missing = [f.name for f in fields if f.metadata.get("required") and not values.get(f.name)]
    if missing:
        parser.error("missing required flag(s): " + ", ".join(f"--{m}" for m in missing))
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def load_yaml(path: str, cls: type, parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    import yaml  # type: ignore[import-untyped]  # no stubs installed; what it returns is checked below

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as e:
        _fail(parser, f"cannot read config file {path}: {e}")
    if not isinstance(data, dict):
        _fail(parser, f"config file {path} must hold a mapping of flag: value, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        _fail(parser, f"config file {path}: unknown key(s) {', '.join(unknown)}")
    return data


def _fail(parser: argparse.ArgumentParser | None, msg: str):
    if parser is not None:
        parser.error(msg)
    raise ValueError(msg)


def to_json(cfg: Any) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)


def log_config(cfg: Any, logger: logging.Logger | None = None) -> None:
    """Logs the resolved config as one JSON line: what actually ran, for the record."""
    (logger or log).info("config %s %s", type(cfg).__name__, to_json(cfg))
