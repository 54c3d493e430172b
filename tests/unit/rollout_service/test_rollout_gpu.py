"""The NCCL path: the same publisher and server code as the CPU tests, backend switched to
``nccl`` (vLLM's own NCCL engine in the workers, vLLM's communicator in the learner).

Needs two CUDA GPUs (NCCL refuses two ranks of one communicator on the same device: the
learner takes GPU 0, the server GPU 1) and the GPU build of vLLM; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from common import protocol as P
from common.tiny import ENDOFTEXT_ID, IM_END_ID
from helpers.rollout_harness import Controller, hf_greedy, perturb, samples_of

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_nccl_push_then_greedy_parity(tiny_model_dir, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one for the learner, one for the rollout server")
    pytest.importorskip("vllm.distributed.device_communicators.pynccl")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().cuda()
    ctrl = Controller(model, weight_timeout_s=120, backend="nccl")  # the one switch
    try:
        ctrl.start(
            "gpu0",
            tmp_path,
            "--weight_transfer_backend",
            "nccl",
            "--gpu_memory_utilization",
            "0.3",
            env={"CUDA_VISIBLE_DEVICES": "1"},
        )
        ctrl.wait_joined(["gpu0"], timeout=600)
        prompts = [[1, 5, 6, 7], [1, 50, 60, 70, 80]]
        for version in (1, 2):
            perturb(model, seed=version)
            assert ctrl.fleet.push(version).updated == ["gpu0"]
            ids = [version * 10 + i for i in range(len(prompts))]
            assert not ctrl.client.submit(
                ids, prompts, P.SamplingParams(temperature=0.0, max_new_tokens=16), policy_version=version
            )
            ctrl.wait_results(ids)
            for pid, prompt in zip(ids, prompts, strict=True):
                (s,) = samples_of(ctrl.results[pid], pid)
                want, _ = hf_greedy(model, prompt, 16, {IM_END_ID, ENDOFTEXT_ID})
                assert s["tokens"] == want and s["version"] == version
    finally:
        ctrl.close()
