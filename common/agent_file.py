"""The identity of an agent file (``--agent_func_path``), the same on the learner and the servers.

A rollout server announces the agent it loaded (``RolloutCapabilities.agent``) and every agent
request names the one the learner was given (``AgentParams.agent``): "<file name>:<first 12 hex
of the file's sha256>", so a server started with another version of the file is refused by
name instead of training on a different environment.

``--agent_func_path`` may also name an environment of a hub instead of a file
(docs/environments.md, "Environments from the hubs"): ``gem:ENV_ID`` or
``gem:ENV_ID?key=value&key=value`` (a value is read as JSON when it parses, else as text). Its
identity is the spec written canonically (keys sorted, values as compact JSON): the learner
needs no hub package installed to name it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HUBS = ("gem",)  # built (rollout_service/hub_envs.py)
# named in the issue, not built: a clear refusal instead of "no such file"
UNSUPPORTED_HUBS = {
    "openenv": "openenv-core 0.3.0 would downgrade pillow 13 to 12.3 in this environment",
    "verifiers": "verifiers wants openai<3 and rayless runs openai 3.x",
}
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class HubSpec:
    """``hub:ENV_ID?k=v&...`` parsed: the environment and its keyword arguments."""

    hub: str
    env_id: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The canonical spec (the agent's identity)."""
        args = "&".join(
            f"{k}={json.dumps(v, separators=(',', ':'), sort_keys=True)}" for k, v in sorted(self.kwargs.items())
        )
        return f"{self.hub}:{self.env_id}" + (f"?{args}" if args else "")


def hub_spec(path: str | Path) -> HubSpec | None:
    """The hub environment ``path`` names, or None for a file path. Raises ValueError naming the
    flag for a malformed spec or a hub rayless does not adapt yet."""
    text = str(path)
    hub, sep, rest = text.partition(":")
    if not sep or hub not in (*HUBS, *UNSUPPORTED_HUBS):
        return None
    if hub in UNSUPPORTED_HUBS:
        raise ValueError(
            f"--agent_func_path {text}: {hub} environments are not supported yet ({UNSUPPORTED_HUBS[hub]}; "
            "docs/environments.md)"
        )
    env_id, _, query = rest.partition("?")
    if not env_id:
        raise ValueError(f"--agent_func_path {text}: no environment id after '{hub}:' (e.g. {hub}:game:Sudoku-v0-easy)")
    kwargs: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or not _KEY.match(key):
            raise ValueError(f"--agent_func_path {text}: {item!r} is not key=value (a Python identifier as the key)")
        if key in kwargs:
            raise ValueError(f"--agent_func_path {text}: {key!r} is given twice")
        try:
            kwargs[key] = json.loads(value)
        except ValueError:
            kwargs[key] = value  # plain text needs no JSON quotes
    return HubSpec(hub, env_id, kwargs)


def check_agent_path(path: str) -> None:
    """A learner's ``--agent_func_path``: a Python file or a hub environment; ValueError otherwise."""
    if hub_spec(path) is None and not path.endswith(".py"):
        raise ValueError(
            f"--agent_func_path {path}: an agent is a Python file (.py) or a hub environment ({', '.join(HUBS)}:ENV_ID)"
        )


def agent_argument(path: str) -> str:
    """``--agent_func_path`` as passed on to another process: a file's absolute path, a spec as it is."""
    return path if hub_spec(path) is not None else os.path.abspath(path)


def agent_identity(path: str | Path) -> str:
    spec = hub_spec(path)
    if spec is not None:
        return spec.text
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ValueError(f"--agent_func_path {path}: cannot read the agent file ({e.strerror})") from None
    return f"{p.name}:{hashlib.sha256(data).hexdigest()[:12]}"
