"""The dependency rules of the code base, checked on every file's imports (function-level too).

- ``learner/algorithms`` (the formulas) imports only torch and the standard library (its
  ``dist_sum`` reaches torch.distributed only when a caller asks for a cross-rank reduce);
- ``learner/controller`` imports neither DeepSpeed nor torch.distributed, nor the learner's
  other sub-packages (which do);
- inside the learner the layers run one way, ``runtime`` -> ``supervised`` -> ``rl``:
  ``learner/runtime`` (DeepSpeed engines, model loading, checkpoints, metrics) imports no other
  learner sub-package but the formulas, ``learner/supervised`` neither ``rl`` nor ``controller``;
- the services (``rollout_service``, ``reward_service``) import no other role: only ``common``;
- ``common`` imports no role.

The rules are read from the source (``ast``), not from ``sys.modules``: ``import torch``
itself loads torch.distributed, so only the text says who asked for it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from helpers.paths import ROOT

ROLES = ("learner", "rollout_service", "reward_service", "launch")
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path``; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from torch import distributed` names the submodule as an attribute
            out += (
                [(node.lineno, f"{base}.{a.name}") for a in node.names] if base in ("torch",) else [(node.lineno, base)]
            )
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _rule_for(rel: Path):
    """A function (module name -> reason it is not allowed, or None) for the file ``rel``."""
    top = rel.parts[0]
    if rel.parts[:2] == ("learner", "algorithms"):

        def algorithms(name: str) -> str | None:
            root = name.split(".")[0]
            if root in STDLIB or root == "torch" or _under(name, "learner.algorithms"):
                return None
            return "learner/algorithms imports only torch"

        return algorithms
    if rel.parts[:2] == ("learner", "controller"):

        def controller(name: str) -> str | None:
            if _under(name, "deepspeed") or _under(name, "torch.distributed"):
                return "learner/controller knows neither DeepSpeed nor torch.distributed"
            if _under(name, "learner") and not _under(name, "learner.controller"):
                return "learner/controller imports no other learner sub-package"
            return None

        return controller
    if rel.parts[:2] == ("learner", "runtime"):

        def runtime(name: str) -> str | None:
            if _under(name, "learner") and not (_under(name, "learner.runtime") or _under(name, "learner.algorithms")):
                return "learner/runtime imports no learner sub-package above it"
            return None

        return runtime
    if rel.parts[:2] == ("learner", "supervised"):

        def supervised(name: str) -> str | None:
            if _under(name, "learner.rl") or _under(name, "learner.controller"):
                return "learner/supervised imports neither learner.rl nor learner.controller"
            return None

        return supervised
    if top in ("rollout_service", "reward_service"):

        def service(name: str) -> str | None:
            root = name.split(".")[0]
            return f"{top} imports only common/ among the project's packages" if root in ROLES and root != top else None

        return service
    if top == "common":

        def common(name: str) -> str | None:
            return "common/ imports no role" if name.split(".")[0] in ROLES else None

        return common
    return None


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for top in ("learner", "rollout_service", "reward_service", "common"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            rule = _rule_for(rel)
            if rule is None:
                continue
            for line, name in sorted(_imports(path, root)):
                why = rule(name)
                if why:
                    out.append(f"{rel}:{line} imports {name}: {why}")
    return out


def test_the_code_base_keeps_its_import_rules():
    assert violations() == []


def test_a_broken_rule_is_reported_with_file_line_and_reason(tmp_path):
    """The checker itself: a tree whose files break each rule once."""
    files = {
        "learner/algorithms/bad.py": "import numpy\nfrom torch import distributed\nfrom common import protocol\n",
        "learner/controller/bad.py": "def f():\n    import deepspeed\n\nfrom learner.rl import run\n",
        "learner/runtime/bad.py": "from learner.supervised import trainer\nfrom learner.algorithms import losses\n",
        "learner/supervised/bad.py": "from learner.rl.config import PPOConfig\nfrom learner.runtime import engine\n",
        "reward_service/bad.py": "from learner.controller import pool\nfrom common import protocol\n",
        "common/bad.py": "import rollout_service.core\n",
        "rollout_service/ok.py": "from . import core\nfrom common.transport import Endpoint\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    got = violations(tmp_path)
    assert got == [
        "learner/algorithms/bad.py:1 imports numpy: learner/algorithms imports only torch",
        "learner/algorithms/bad.py:3 imports common: learner/algorithms imports only torch",
        "learner/controller/bad.py:2 imports deepspeed: learner/controller knows neither DeepSpeed nor torch.distributed",
        "learner/controller/bad.py:4 imports learner.rl: learner/controller imports no other learner sub-package",
        "learner/runtime/bad.py:1 imports learner.supervised: learner/runtime imports no learner sub-package above it",
        "learner/supervised/bad.py:1 imports learner.rl.config: learner/supervised imports neither learner.rl nor "
        "learner.controller",
        "reward_service/bad.py:1 imports learner.controller: reward_service imports only common/ among the project's "
        "packages",
        "common/bad.py:1 imports rollout_service.core: common/ imports no role",
    ]
