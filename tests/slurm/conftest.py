"""Tests that need a running Slurm: `make test-slurm` starts an emulated cluster
(launch/slurm_emulation/cluster.sh) and runs them inside it.

Collected only there (the cluster script sets RAYLESS_SLURM_DIR): `make test` walks tests/
too, and without a cluster these tests could only fail or skip. They also carry the `slurm`
marker, so `-m "not slurm"` leaves them out even inside a cluster.
"""

import os

if not os.environ.get("RAYLESS_SLURM_DIR"):
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    # Registered here rather than in pyproject.toml: editing that file makes every checkout's
    # `make` re-run its set-up.
    config.addinivalue_line("markers", "slurm: needs a running Slurm (make test-slurm's emulated cluster)")
