"""The identity of an agent file (``--agent_func_path``), the same on the learner and the servers.

A rollout server announces the agent it loaded (``RolloutCapabilities.agent``) and every agent
request names the one the learner was given (``AgentParams.agent``): "<file name>:<first 12 hex
of the file's sha256>", so a server started with another version of the file is refused by
name instead of training on a different environment.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def agent_identity(path: str | Path) -> str:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ValueError(f"--agent_func_path {path}: cannot read the agent file ({e.strerror})") from None
    return f"{p.name}:{hashlib.sha256(data).hexdigest()[:12]}"
