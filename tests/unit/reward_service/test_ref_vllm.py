"""The reward service's vLLM reference backend (``--ref_backend vllm``, for reference models
larger than one GPU), as a process with the test as its controller: its log-probs equal the
transformers backend's on the tiny model (fp32), and it exits 0 after Shutdown; a memory share
vLLM-CPU would refuse is one line and exit 2; the flags it cannot honour are refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from common import protocol as P
from common.vllm_memory import KV_SPACE_ENV
from helpers.reward_controller import ENV, ROOT, FakeController
from reward_service.config import parse_config


@pytest.mark.slow
def test_vllm_reference_logprobs_equal_transformers_and_the_service_exits_0(tiny_model_dir, tmp_path):
    """One ScoreRequest (four samples, one with an empty response) to ``python -m reward_service
    --ref_backend vllm``: its reference log-probs are transformers' to 1e-4. Its Hello says what
    the engine runs with. After Shutdown the process exits 0 -- its own code, through the
    interpreter's teardown, which after vLLM's shutdown used to die of SIGABRT in CI now and then
    (vLLM's client threads still running; ``VLLMReferenceScorer.close``)."""
    from reward_service.ref_model import ReferenceScorer

    ctrl = FakeController(tmp_path)
    try:
        proc, hello = ctrl.start(
            "rw-vllm",
            *("--ref_pretrain", str(tiny_model_dir), "--ref_backend", "vllm", "--ref_enforce_eager"),
            *("--ref_max_model_len", "128", "--ref_idle_spin_s", "0.05"),
            timeout=300,
        )
        caps = hello.capabilities
        assert caps.sources == ["ref"] and caps.ref_logprobs
        assert caps.ref_idle_spin_s == 0.05  # --ref_idle_spin_s reached the engine's worker (vLLM's own: 1 s)
        assert 0 < caps.ref_gpu_memory_utilization < 0.9  # on CPU what the engine needs, not the GPU default

        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 200, (n,), generator=g) for n in (5, 17, 1, 9)]
        responses = [torch.randint(3, 200, (n,), generator=g) for n in (4, 11, 6, 0)]  # one empty
        samples = P.SampleBatch(
            prompt_ids=[0, 1, 2, 3],
            sample_indices=[0] * 4,
            response_lengths=[len(r) for r in responses],
            response_ids=torch.cat(responses).to(torch.int32),
            prompt_token_ids=[p.tolist() for p in prompts],
        )
        out = ctrl.ep.call(P.ScoreRequest(samples=samples), to=b"rw-vllm", timeout=120)
        assert isinstance(out, P.ScoredBatch), out
        want = ReferenceScorer.load(str(tiny_model_dir)).logprobs(prompts, responses)
        got = torch.as_tensor(out.ref_logprobs)
        assert got.shape == want.shape == (21,)
        assert (got - want).abs().max() < 1e-4

        assert isinstance(ctrl.ep.call(P.Shutdown(reason="test done"), to=b"rw-vllm", timeout=60), P.Ack)
        code = proc.wait(120)
        log = (tmp_path / "rw-vllm.log").read_text(errors="replace")
        assert "its client's output thread and ZeroMQ context are closed too" in log, log[-4000:]
        assert code == 0 and "terminate called" not in log, log[-4000:]
    finally:
        ctrl.stop()


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
