"""The reward service's vLLM reference backend (``--ref_backend vllm``, for reference models
larger than one GPU): its log-probs equal the transformers backend's on the tiny model (fp32),
through the service's own config -> Scorer path; a memory share vLLM-CPU would refuse is one line
and exit 2; and the flags it cannot honour are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.vllm_memory import KV_SPACE_ENV
from helpers.paths import HELPERS
from helpers.reward_controller import ENV, ROOT
from reward_service.config import parse_config


@pytest.mark.slow
def test_vllm_reference_logprobs_equal_transformers(tiny_model_dir):
    proc = subprocess.run(
        [sys.executable, str(HELPERS / "ref_vllm_parity.py"), str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["lengths"] == [21, 21] and r["sources"] == ["ref"]
    assert r["max_abs_diff"] < 1e-4, r
    assert r["ref_idle_spin_s"] == 0.05, r  # --ref_idle_spin_s reached the engine's worker (vLLM's own: 1 s)


@pytest.mark.slow
def test_a_share_vllm_would_refuse_is_one_line_and_exit_2(tiny_model_dir, tmp_path):
    """The reference engine checks its share as the rollout server does: a share of 1 without
    VLLM_CPU_KVCACHE_SPACE (the whole node free: never, on a running host) stops the service
    before any vLLM process starts, in one error line naming --ref_gpu_memory_utilization."""
    out = subprocess.run(
        [sys.executable, "-m", "reward_service", "--controller", "tcp://127.0.0.1:1", "--name", "rw-full"]
        + ["--ref_pretrain", str(tiny_model_dir), "--ref_backend", "vllm", "--ref_gpu_memory_utilization", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in {**os.environ, **ENV}.items() if k != KV_SPACE_ENV},
    )
    log = out.stdout + out.stderr
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert out.returncode == 2 and len(errors) == 1, log[-3000:]
    assert "rw-full: vLLM-CPU will not start: --ref_gpu_memory_utilization 1 asks for" in errors[0]
    assert "Traceback" not in log and "(EngineCore" not in log


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "0.7"], "--temperature must be 1"),
        (["--ref_tensor_parallel_size", "0"], "--ref_tensor_parallel_size must be >= 1"),
        (["--ref_idle_spin_s", "-1"], "--ref_idle_spin_s must be >= 0"),
        (["--ref_gpu_memory_utilization", "1.5"], "--ref_gpu_memory_utilization must be in (0, 1]"),
    ],
)
def test_flags_the_vllm_reference_cannot_honour_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--controller", "tcp://h:1", "--ref_pretrain", "m", "--ref_backend", "vllm", *extra])
    assert message in capsys.readouterr().err


def test_an_idle_spin_for_the_hf_reference_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--controller", "tcp://h:1", "--ref_pretrain", "m", "--ref_idle_spin_s", "0.05"])
    assert "--ref_idle_spin_s is the idle spin of --ref_backend vllm's workers" in capsys.readouterr().err
