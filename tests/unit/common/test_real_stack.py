"""The real stack runs on the tiny model: DeepSpeed ZeRO-2/3 trains it on CPU (gloo), in a
subprocess (DeepSpeed wants a torch.distributed world of its own). That vLLM-CPU generates what
transformers generates is checked through the rollout service itself, on the weights loaded
from disk and after pushes (tests/unit/rollout_service/test_rollout_service.py): one engine
start serves both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.transport import free_port
from helpers.paths import HELPERS


def _run_helper(script: str, *args: str, env: dict | None = None, timeout: float = 240) -> dict:
    """Run a helper script; return the JSON after its `RESULT ` line (its log on failure)."""
    proc = subprocess.run(
        [sys.executable, str(HELPERS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{script} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
        f"\n--- stderr ---\n{proc.stderr[-8000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


def _single_rank_env() -> dict:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }


@pytest.mark.slow
@pytest.mark.timeout(240)  # a cold TORCH_EXTENSIONS_DIR adds ~35 s: DeepSpeed JIT-builds its shm comm op
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_step_on_cpu(tiny_model_dir, stage):
    r = _run_helper("deepspeed_step.py", str(tiny_model_dir), "--stage", str(stage), env=_single_rank_env())
    assert r["inner_optimizer"] == "AdamW"
    assert r["loaded_matches_checkpoint"]  # ZeRO-3: HfDeepSpeedConfig + from_pretrained loaded real weights
    if stage == 3:
        assert r["partitioned"]  # built under zero.Init, not gathered on one rank
    first, second = r["losses"]
    assert second < first  # one lr=1e-2 step on the same batch must lower its loss
    assert r["embed_max_change"] > 1e-4  # the step reached the weights
    assert r["still_tied"]
