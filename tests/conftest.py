"""Shared pytest fixtures and markers. CPU by default; `gpu` tests skip without CUDA."""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest

# The ceiling of the whole suite's wall time as `make test` runs it (three workers) on the
# developers' kind of host (2 cores, 24 GiB), in seconds; docs/testing.md says how it was
# measured, how to keep it, and the goal it is measured against.
BUDGET_S = 750
BUDGET_WORKERS = 3
_started = time.monotonic()

# vLLM-CPU's default binding ('auto') puts each engine's OpenMP threads on the node's cores but
# one it reserves: on these 2-core hosts, core 0 for every engine, whatever else runs there. With
# several tests at a time and up to three engines each, the suite's engines all computed on core 0
# while the learners had core 1. Unbound, an engine's one thread (OMP_NUM_THREADS=1) goes where
# the kernel finds room. Every process the tests start inherits this; the tests of the binding
# itself set their own (tests/unit/launch/test_cpu_cores.py).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("markexpr") or config.args != config.getini("testpaths"):
        return  # a selection: the budget is the whole suite's
    took = time.monotonic() - _started
    workers = getattr(config.option, "numprocesses", None) or 0
    if workers != BUDGET_WORKERS:
        how = f"{workers} workers" if workers else "one process"
        terminalreporter.write_line(
            f"test suite: {took:.0f} s in {how} (the budget, {BUDGET_S} s, is for `make test`'s "
            f"{BUDGET_WORKERS} workers; docs/testing.md)"
        )
        return
    verdict = "within" if took <= BUDGET_S else "OVER"
    terminalreporter.write_line(
        f"test suite: {took:.0f} s, {verdict} its budget of {BUDGET_S} s on a 2-core host (docs/testing.md)"
    )


FLEET_UNIT = "shared_fleet"
_FLEET_TESTS: dict[Path, frozenset[str]] = {}  # by test file: _fleet_tests


def _fleet_tests(path: Path) -> frozenset[str]:
    """Names of the test functions in a test file that take the ``shared_fleet`` fixture."""
    if path not in _FLEET_TESTS:
        tree = ast.parse(path.read_text()) if path.suffix == ".py" and path.exists() else ast.Module(body=[])
        _FLEET_TESTS[path] = frozenset(
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and any(arg.arg == "shared_fleet" for arg in node.args.args)
        )
    return _FLEET_TESTS[path]


def work_unit(root: Path, nodeid: str) -> str:
    """What one pytest-xdist worker runs whole: the runs that join the shared fleet (one fleet,
    started once), else the test's module (its module-scoped fixtures start once)."""
    module, _, rest = nodeid.partition("::")
    name = rest.split("::")[-1].split("[")[0]
    return FLEET_UNIT if name in _fleet_tests(root / module) else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` (what ``make test`` runs) with ``work_unit`` as the scope. (xdist's
    own ``loadgroup`` would do it from marks, but it renames node ids in a way pytest 9 no
    longer reads, so its groups come apart.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(config.rootpath, nodeid)

    return WorkUnits(config, log)


def pytest_collection_modifyitems(config, items):
    # The runs that join the session's shared fleet run one after another, in one process (the
    # fleet is started once, for the first of them); those that kill one of its servers (marked
    # breaks_fleet) after the rest of them.
    # Under pytest-xdist (`make test`: three workers) each unit of work (``work_unit``) runs whole
    # on one worker, and a worker takes the next unit in the order the items have here when it
    # is nearly done with its own: the fleet's runs first (the longest chain: the fleet starts,
    # then ~10 runs one by one), then the modules marked slow (engines, learners), then the
    # quick ones, so that the units left at the end, which one worker may finish while the
    # others idle, are short.
    # In a single process the fleet's runs go last instead: the idle fleet then holds no memory
    # while another test starts vLLM of its own.
    in_worker = "PYTEST_XDIST_WORKER" in os.environ

    def order(item) -> tuple[int, int]:
        within = 1 if item.get_closest_marker("breaks_fleet") else 0
        if "shared_fleet" in item.fixturenames:
            return (0 if in_worker else 3, within)
        return (1 if item.get_closest_marker("slow") else 2, 0) if in_worker else (0, 0)

    items.sort(key=order)  # stable: the order within each part is kept
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # spare CPU-only runs the torch import
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of the tiny Qwen2 model + tokenizer (common/tiny.py), built once per session."""
    from common.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def restore_signal_handlers():
    """Tests that let a service install its SIGTERM/SIGINT handlers put pytest's back after."""
    import signal

    from common.service import STOP_SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="session")
def _fleet(tiny_model_dir, tmp_path_factory):
    from helpers.shared_fleet import SharedFleet

    fleet = SharedFleet(tiny_model_dir, tmp_path_factory.mktemp("shared_fleet"))
    yield fleet
    fleet.stop()


@pytest.fixture
def shared_fleet(_fleet, request):
    """The session's rollout servers and reward service (tests/helpers/shared_fleet.py), for a
    run that joins them (``local_cmd(..., fleet=shared_fleet)``). They outlive the run: a run
    that ends well leaves them serving (``--keep_services``), and the test fails if it did not
    (unless it is marked ``breaks_fleet``: it killed one itself)."""
    died = _fleet.ensure()
    if died:  # killed by a breaks_fleet test, or broken by an earlier one: started again
        print("shared fleet: started again:", "; ".join(died))
    yield _fleet
    if not request.node.get_closest_marker("breaks_fleet"):
        assert _fleet.alive(), f"a shared service died during the test; logs in {_fleet.folder}"
