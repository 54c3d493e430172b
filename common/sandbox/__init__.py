"""Sandboxed execution of model-written code, for agent tools and reward functions.

In ``common/`` because both services use it: a reward file run by the reward service's function
workers (``examples/rewards/code_tests.py``) and an environment's tool in a rollout server's
environment workers; services import only ``common/``. What it isolates, and what not, is in
docs/environments.md.
"""

from common.sandbox.pool import ISOLATION_MODES, Sandbox, SandboxError, default_ro_paths
from common.sandbox.result import REASONS, SandboxLimits, SandboxResult

__all__ = [
    "ISOLATION_MODES",
    "REASONS",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "default_ro_paths",
]
