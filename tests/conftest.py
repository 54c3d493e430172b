"""Shared pytest fixtures and markers. CPU by default; `gpu` tests skip without CUDA."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
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
