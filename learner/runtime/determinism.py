"""Seeding, and deterministic kernels for ``--train.full_determinism_enable``.

``seed_everything(seed)`` seeds Python's ``random``, NumPy and torch (every device), as OpenRLHF
seeds each of its processes with ``transformers.set_seed``. With ``full_determinism`` it also
makes torch choose deterministic kernels, the switches of ``transformers.enable_full_determinism``
that OpenRLHF 0.10's ``--train.full_determinism_enable`` calls:

- ``torch.use_deterministic_algorithms(True)``: an op without a deterministic kernel raises,
  naming itself, instead of running a nondeterministic one (scatter-add style atomics);
- cuDNN deterministic, its autotuner (``benchmark``) off: the autotuner may pick another
  convolution algorithm per run;
- ``CUBLAS_WORKSPACE_CONFIG`` (``:16:8`` as transformers, unless set already): cuBLAS >= 10.2 is
  deterministic only with a fixed workspace. It is read when the first cuBLAS handle is made,
  so this runs before the first matmul (``learner.rl.run.init_process`` calls it first);
- ``FLASH_ATTENTION_DETERMINISTIC=1``: transformers passes ``deterministic=True`` to flash-attn's
  backward, which otherwise accumulates with atomics.

Not set, unlike transformers: ``CUDA_LAUNCH_BLOCKING=1`` (synchronous launches; torch's notes
need it for cuBLAS before CUDA 10.2 only, and every launch would wait) and the Ascend NPU
variables. What it cannot make deterministic: the samples, which vLLM draws in the rollout
servers (``--seed_sampling`` seeds each prompt's sampling there), and reductions whose order
changes with the number of ranks.
"""

from __future__ import annotations

import os
import random

import torch

__all__ = ["seed_everything"]


def seed_everything(seed: int, *, full_determinism: bool = False) -> None:
    """Seed ``random``, NumPy and torch with ``seed``; with ``full_determinism``, deterministic
    kernels only (see the module docstring). Process-wide: call once, before the models load."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's wheels
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator, CUDA's included
    if not full_determinism:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
