"""The rollout server's request errors, shared by the core and the objects it is made of.

Apart from ``core.py`` so that the weight session, the adapter registry and the episode runner
can raise them without importing the core that holds them (``core`` re-exports them).
"""

from __future__ import annotations


class NotSupported(RuntimeError):
    """The request is valid but this server cannot do it (e.g. sleep mode on CPU)."""


class BadRequest(ValueError):
    """The request is malformed or contradicts this server's configuration."""


class AgentFailed(Exception):
    """An agent episode failed (the environment's fault, not the server's): the prompt is answered
    with an error the controller re-issues."""
