"""Dataclass configs generated into argparse: one field, one flag, one line of help.

A config is a dataclass whose fields are flags or *sections* (dataclasses of their own, nested
as deep as they need). A flag's dotted name is its path through the sections, so a config
shaped like OpenRLHF 0.10's takes its flags as written (``--algo.kl.init_coef``)::

    @dataclass
    class KLSection:
        init_coef: float = flag(0.01, "KL coefficient", flat="init_kl_coef")

    @dataclass
    class AlgoSection:
        kl: KLSection = section(KLSection, "KL control")

    @dataclass
    class Config:
        algo: AlgoSection = section(AlgoSection, "the algorithm")
        port: int = flag(5000, "where to listen")           # top level: --port

Each flag answers to its dotted name and, declared next to it once (``flat=``), to the flat
name of OpenRLHF's older releases (``--init_kl_coef``); both may be mixed in one command. The
same flag given once per spelling with two different values is an error naming both. A flat
name declared on several flags (``--max_norm``: the actor's and the critic's) sets all of them.
A section embedded in several places declares its flat names where it is embedded
(``section(AdamSection, flat={"lr": "actor_learning_rate"})``) and may change its defaults there.
Booleans are ``--flag`` / ``--no-flag``. ``inert=`` marks a flag accepted for compatibility that
cannot act here: giving it is explained in one line (``inert_notices``: a config with a
``notices`` list gets them there, for the run to log at start-up), never silently ignored.

``parse(Config, argv)`` builds the parser, optionally layers a YAML file given with ``--config``
(nested sections, dotted or flat keys), validates (each dataclass's ``__post_init__``) and
returns the instance. ``build(Config, **values)`` does the same from Python (keys: flat or
dotted names), for tests and callers that compose a config. This module imports nothing heavy,
so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
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
    flat: str = "",
    flat_const: Any = dataclasses.MISSING,
    inert: str = "",
) -> Any:
    """A flag. ``flat``: its older flat name (``--init_kl_coef`` for ``algo.kl.init_coef``);
    with ``flat_const`` the flat spelling is a switch that sets this value (``--bf16`` for
    ``--ds.param_dtype bf16``). ``aliases``: other spellings, e.g. a misnomer kept working.
    ``group``: the help section of a flag in a config without sections. ``inert``: why the flag
    cannot act here (accepted so scripts run; setting it is said at start-up)."""
    meta = {
        "help": help,
        "required": required,
        "choices": choices,
        "aliases": tuple(aliases),
        "group": group,
        "flat": flat,
        "flat_const": flat_const,
        "inert": inert,
    }
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(
    cls: type, help: str = "", *, flat: Mapping[str, str] | None = None, defaults: Mapping[str, Any] | None = None
) -> Any:
    """A section field: a dataclass of flags named ``<field>.<its flags>``. ``flat`` gives (or
    overrides) the flat names of its flags for this place; ``defaults`` changes their defaults here."""
    given = dict(defaults or {})
    meta = {"section": True, "help": help, "flat": dict(flat or {})}
    # a callable default is called for each new instance (a sub-section's default)
    return dataclasses.field(
        default_factory=lambda: cls(**{k: v() if callable(v) else v for k, v in given.items()}), metadata=meta
    )


@dataclass(frozen=True)
class Leaf:
    """One flag of a config: where it sits and how it is spelled."""

    path: str  # dotted: "algo.kl.init_coef" (a top-level flag: its name)
    field: dataclasses.Field
    type: Any  # the element type (int, float, str, bool, ...)
    is_list: bool
    default: Any
    flat: str  # the older flat name, "" when none (or the same as the path)
    section_help: str

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata

    @property
    def names(self) -> list[str]:
        """Every spelling, dotted first: ``--algo.kl.init_coef``, ``--init_kl_coef``."""
        names = [f"--{self.path}"]
        if self.flat and self.flat != self.path:
            names.append(f"--{self.flat}")
        return names + [a for a in self.meta.get("aliases", ())]


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


def _section_type(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def leaves(cls: type, prefix: str = "", flat: Mapping[str, str] | None = None, instance: Any = None) -> Iterator[Leaf]:
    """Every flag of ``cls``, sections walked depth first in declaration order."""
    hints = typing.get_type_hints(cls)
    instance = instance if instance is not None else _defaults(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}{f.name}"
        sub = _section_type(hints[f.name])
        if sub is not None and f.metadata.get("section"):
            here = {**f.metadata.get("flat", {})}
            # a flat name given by an outer section for "inner.leaf" reaches the inner one
            for k, v in (flat or {}).items():
                if k.startswith(f"{f.name}."):
                    here[k[len(f.name) + 1 :]] = v
            yield from leaves(sub, f"{path}.", here, getattr(instance, f.name))
            continue
        tp, is_list = _base_type(hints[f.name])
        default = getattr(instance, f.name) if instance is not None else None
        flat_name = (flat or {}).get(f.name) or f.metadata.get("flat", "")
        yield Leaf(path, f, tp, is_list, default, flat_name, "")


def _defaults(cls: type) -> Any:
    """An instance with every default, built without validation (``__post_init__`` may require
    flags a bare default does not give)."""
    obj: Any = object.__new__(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            sub = _section_type(hints[f.name])
            value = _defaults(sub) if sub else None
        object.__setattr__(obj, f.name, value)
    return obj


def _sections(cls: type, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, help) of every section, depth first."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = _section_type(hints[f.name])
        if sub is not None and f.metadata.get("section"):
            yield f"{prefix}{f.name}", f.metadata.get("help", "")
            yield from _sections(sub, f"{prefix}{f.name}.")


_SECRET_FLAGS = ("wandb.key",)  # flags whose values are secrets (learner.runtime.tracking.Secret)


class _Seen:
    """Which spelling set each flag, so one flag given twice with two values is caught."""

    KEY = "_rayless_seen"

    @classmethod
    def record(cls, parser: argparse.ArgumentParser, namespace: argparse.Namespace, dest: str, value: Any, opt: str):
        seen: dict[str, tuple[str, Any]] = namespace.__dict__.setdefault(cls.KEY, {})
        spelling = opt.replace("--no-", "--", 1) if opt else opt
        prev = seen.get(dest)
        if prev is not None and prev[0] != spelling and prev[1] != value:
            if dest.endswith(_SECRET_FLAGS):  # a key is never printed, not even in an error
                parser.error(f"{prev[0]} and {opt} set the same flag (--{dest}) to different values: give it once")
            parser.error(
                f"{_shown(prev[0], prev[1])} and {_shown(opt, value)} set the same flag (--{dest}) to "
                "different values: give it once"
            )
        seen[dest] = (spelling, value)


def _shown(opt: str, value: Any) -> str:
    if isinstance(value, bool):
        return opt if value else opt.replace("--", "--no-", 1) if not opt.startswith("--no-") else opt
    if isinstance(value, list):
        return f"{opt} {' '.join(map(str, value))}"
    return f"{opt} {value}"


class _Store(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        _Seen.record(parser, namespace, self.dest, values, option_string or "")
        setattr(namespace, self.dest, values)


class _Bool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        value = not (option_string or "").startswith("--no-")
        _Seen.record(parser, namespace, self.dest, value, option_string or "")
        setattr(namespace, self.dest, value)


class _Fanout(argparse.Action):
    """A flat name shared by several flags, or a flat switch standing for a value: sets each target."""

    def __init__(self, *args: Any, targets: Sequence[str] = (), const_value: Any = dataclasses.MISSING, **kw: Any):
        self.targets = tuple(targets)
        self.const_value = const_value
        super().__init__(*args, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        value = values if self.const_value is dataclasses.MISSING else self.const_value
        for dest in self.targets:
            _Seen.record(parser, namespace, dest, value, option_string or "")
            setattr(namespace, dest, value)


def _type_kwargs(leaf: Leaf) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"metavar": leaf.path.rpartition(".")[2].upper()}
    if leaf.meta.get("choices"):
        kwargs["choices"] = leaf.meta["choices"]
    if leaf.is_list:
        kwargs.update(nargs="+", type=leaf.type)
    elif leaf.type in (int, float, str):
        kwargs["type"] = leaf.type
    return kwargs


def _help(leaf: Leaf) -> str:
    text = leaf.meta.get("help", "") or " "
    if leaf.meta.get("inert"):
        text = f"{text} [accepted, cannot act here: {leaf.meta['inert']}]"
    return f"{text} (default: {leaf.default})".replace("%", "%%")


def build_parser(
    cls: type, description: str = "", prog: str | None = None, *, raise_errors: bool = False
) -> argparse.ArgumentParser:
    parser_class = _RaisingParser if raise_errors else argparse.ArgumentParser
    # The usage line would list every flag (180 in train_ppo): the groups below say them once each.
    usage = "%(prog)s [-h] [--config YAML] [--SECTION.FLAG VALUE | --FLAT_NAME VALUE ...]"
    parser = parser_class(
        prog=prog, description=description, usage=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="YAML file of flag values; command-line flags override it")
    groups: dict[str, Any] = {}
    for path, text in _sections(cls):
        groups[path] = parser.add_argument_group(path, text or None)
    all_leaves = list(leaves(cls))
    by_flat: dict[str, list[Leaf]] = {}
    for leaf in all_leaves:
        if leaf.flat and leaf.flat != leaf.path:
            by_flat.setdefault(leaf.flat, []).append(leaf)
    shared = {
        name
        for name, ls in by_flat.items()
        if len(ls) > 1 or any(x.meta.get("flat_const", dataclasses.MISSING) is not dataclasses.MISSING for x in ls)
    }
    for leaf in all_leaves:
        section_path = leaf.path.rpartition(".")[0]
        target = groups.get(section_path)
        if target is None:
            group = leaf.meta.get("group") or ""
            target = parser if not group else groups.setdefault(group, parser.add_argument_group(group))
        names = [n for n in leaf.names if n.lstrip("-") not in shared]
        if leaf.type is bool and not leaf.is_list:
            target.add_argument(*names, dest=leaf.path, action=_Bool, default=argparse.SUPPRESS, help=_help(leaf))
            continue
        target.add_argument(
            *names, dest=leaf.path, action=_Store, default=argparse.SUPPRESS, help=_help(leaf), **_type_kwargs(leaf)
        )
    if shared:
        flat_group = parser.add_argument_group("older flat names that set several flags")
        for name in sorted(shared):
            ls = by_flat[name]
            const = ls[0].meta.get("flat_const", dataclasses.MISSING)
            targets = [x.path for x in ls]
            says = "sets " + ", ".join(f"--{t}" for t in targets)
            if const is not dataclasses.MISSING:
                flat_group.add_argument(
                    f"--{name}",
                    dest=f"flat:{name}",
                    action=_Fanout,
                    nargs=0,
                    targets=targets,
                    const_value=const,
                    default=argparse.SUPPRESS,
                    help=f"{says} to {const}",
                )
            else:
                leaf = ls[0]
                kwargs = _type_kwargs(leaf)
                if leaf.type is bool:
                    kwargs = {"nargs": 0, "const_value": True}
                flat_group.add_argument(
                    f"--{name}",
                    dest=f"flat:{name}",
                    action=_Fanout,
                    targets=targets,
                    default=argparse.SUPPRESS,
                    help=says,
                    **kwargs,
                )
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
    ns.pop(_Seen.KEY, None)
    values: dict[str, Any] = {}
    path = ns.pop("config", None)
    if path:
        values.update(load_yaml(path, cls, parser))
    values.update({k: v for k, v in ns.items() if not k.startswith("flat:")})
    missing = [leaf for leaf in leaves(cls) if leaf.meta.get("required") and not values.get(leaf.path)]
    if missing:
        parser.error("missing required flag(s): " + ", ".join(" / ".join(m.names[:2]) for m in missing))
    try:
        return _with_notices(_build(cls, values), values)
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def given(cls: type, argv: Sequence[str]) -> set[str]:
    """The dotted paths of the flags ``argv`` sets, in whichever spelling (a launcher that adds
    defaults of its own leaves out those the user gave). Raises ConfigError for a bad argv."""
    ns = vars(build_parser(cls, raise_errors=True).parse_args(argv))
    return set(ns.get(_Seen.KEY, {}))


def build(cls: type[T], **values: Any) -> T:
    """``cls`` from Python values keyed by flag name, flat or dotted (``build(PPOConfig,
    pretrain="m", **{"algo.kl.init_coef": 0.0})``). An unknown name is a ValueError naming it."""
    given = resolve_names(cls, values, "build()")
    return _with_notices(_build(cls, given), given)


def resolve_names(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` keyed by dotted path: flat names, aliases and dotted names all resolved."""
    index: dict[str, list[str]] = {}
    for leaf in leaves(cls):
        for name in leaf.names:
            index.setdefault(name[2:], []).append(leaf.path)
    out: dict[str, Any] = {}
    unknown = []
    for key, value in values.items():
        targets = index.get(key)
        if not targets:
            unknown.append(key)
            continue
        for t in targets:
            if t in out and out[t] != value:
                raise ValueError(f"{where}: {key}={value!r} and another spelling of --{t} ({out[t]!r}) disagree")
            const = _leaf(cls, t).meta.get("flat_const", dataclasses.MISSING)
            out[t] = const if (const is not dataclasses.MISSING and key != t and value is True) else value
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    return out


def _leaf(cls: type, path: str) -> Leaf:
    for leaf in leaves(cls):
        if leaf.path == path:
            return leaf
    raise KeyError(path)


def _build(cls: type[T], values: Mapping[str, Any], prefix: str = "", base: Any = None) -> T:
    hints = typing.get_type_hints(cls)
    base = base if base is not None else _defaults(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # every config class is a dataclass
        if not f.init:
            continue
        path = f"{prefix}{f.name}"
        sub = _section_type(hints[f.name])
        if sub is not None and f.metadata.get("section"):
            kwargs[f.name] = _build(sub, values, f"{path}.", getattr(base, f.name))
        elif path in values:
            kwargs[f.name] = values[path]
        else:
            kwargs[f.name] = getattr(base, f.name)
    return cls(**kwargs)


def load_yaml(path: str, cls: type, parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """A YAML file of flag values, by path: nested sections (``algo: {kl: {init_coef: 0}}``),
    dotted keys (``algo.kl.init_coef: 0``) or flat names (``init_kl_coef: 0``)."""
    import yaml  # type: ignore[import-untyped]  # no stubs installed; what it returns is checked below

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as e:
        _fail(parser, f"cannot read config file {path}: {e}")
    if not isinstance(data, dict):
        _fail(parser, f"config file {path} must hold a mapping of flag: value, got {type(data).__name__}")
    section_paths = {p for p, _ in _sections(cls)}

    def flatten(d: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key in section_paths:
                yield from flatten(v, f"{key}.")
            else:
                yield key, v

    try:
        return resolve_names(cls, dict(flatten(data, "")), f"config file {path}")
    except ValueError as e:
        _fail(parser, str(e))


def _fail(parser: argparse.ArgumentParser | None, msg: str) -> typing.NoReturn:
    if parser is not None:
        parser.error(msg)
    raise ValueError(msg)


def inert_notices(cls: type, given: Mapping[str, Any]) -> list[str]:
    """One line for each flag given (``given``: values by path) that is accepted for compatibility
    but cannot act here."""
    out = []
    for leaf in leaves(cls):
        reason = leaf.meta.get("inert")
        if reason and leaf.path in given:
            out.append(f"--{leaf.path} {_shown_value(given[leaf.path])}: accepted, but {reason}")
    return out


def _shown_value(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _with_notices(obj: T, given: Mapping[str, Any]) -> T:
    """A config that keeps ``notices`` (what its checks changed or found inert) gets the inert
    flags' lines first."""
    notices = getattr(obj, "notices", None)
    if isinstance(notices, list):
        # ``given_notices(given)``: a config's own lines about flags given that its values leave
        # without effect (e.g. --muon.lr without --optim muon), which __post_init__ cannot tell
        # from a default.
        own = getattr(obj, "given_notices", None)
        notices[:0] = inert_notices(type(obj), given) + (own(given) if callable(own) else [])
    return obj


def get(cfg: Any, path: str) -> Any:
    """The value at a dotted path (``get(cfg, "algo.kl.init_coef")``)."""
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def flag_names(cls: type) -> set[str]:
    """Every spelling ``cls`` accepts, without the dashes (both spellings, aliases, negations not included)."""
    names = {n[2:] for leaf in leaves(cls) for n in leaf.names}
    return names


def to_json(cfg: Any) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)


def log_config(cfg: Any, logger: logging.Logger | None = None) -> None:
    """Logs the resolved config as one JSON line: what actually ran, for the record."""
    (logger or log).info("config %s %s", type(cfg).__name__, to_json(cfg))
