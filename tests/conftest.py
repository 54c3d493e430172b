"""Shared pytest fixtures and markers. CPU by default; `gpu` tests skip without CUDA."""

from __future__ import annotations

import time

import pytest

# The ceiling of the whole suite's wall time on the developers' kind of host (2 cores, 24 GiB),
# in seconds; docs/testing.md says how it was measured, how to keep it, and the goal below it.
BUDGET_S = 1200
_started = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("markexpr") or config.args != config.getini("testpaths"):
        return  # a selection: the budget is the whole suite's
    took = time.monotonic() - _started
    verdict = "within" if took <= BUDGET_S else "OVER"
    terminalreporter.write_line(
        f"test suite: {took:.0f} s, {verdict} its budget of {BUDGET_S} s on a 2-core host (docs/testing.md)"
    )


def pytest_collection_modifyitems(config, items):
    # The runs that join the session's shared fleet go last, one after another: the fleet is
    # started for the first of them and stopped at the end, so it idles through no other test
    # (and holds none of the memory a test starting its own vLLM needs).
    # Those that kill one of its servers (marked breaks_fleet) go after the rest of them.
    def order(item) -> int:
        if "shared_fleet" not in item.fixturenames:
            return 0
        return 2 if item.get_closest_marker("breaks_fleet") else 1

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
