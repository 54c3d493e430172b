"""The learner's engine set-up runs where pyzmq is absent (the GPU device machine of
docs/colocated.md has torch and DeepSpeed but no ZeroMQ): it must not import it."""

import subprocess
import sys

from tests.helpers.paths import ROOT


def test_engine_imports_without_pyzmq():
    code = "import sys; sys.modules['zmq'] = None; import learner.runtime.engine; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
