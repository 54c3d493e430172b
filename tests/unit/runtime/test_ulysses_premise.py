"""The premise of sequence parallelism in rayless (issue 41's second part, built on it in
learner/runtime/sequence_parallel.py; docs/long-context.md): DeepSpeed's Ulysses attention for HF models runs on CPU over gloo, and a
sequence split across 2 ranks gives the unsplit forward's logits and, summed over the ranks, its
gradients. Checked on the tiny model with SDPA, one unpadded 24-token sequence split 12 + 12 with
its position ids, so that a DeepSpeed, transformers or torch upgrade that breaks it is seen before
the feature is built on it.

Worker: ``torchrun --nproc_per_node 2 tests/unit/runtime/test_ulysses_premise.py MODEL_DIR``
prints ``RESULT {...}`` on each rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LENGTH = 24


def worker(model_dir: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    ids = torch.randint(3, 700, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(LENGTH)[None]
    # Unsplit first: registering replaces SDPA in transformers' attention table for the process.
    whole = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    whole.logsumexp(-1).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, micro_batch_size=1)
    shard = slice(rank * LENGTH // world, (rank + 1) * LENGTH // world)
    logits = model(input_ids=ids[:, shard], position_ids=pos[:, shard], use_cache=False).logits
    logits.logsumexp(-1).sum().backward()
    for p in model.parameters():  # each rank holds its shard's share of the gradient
        dist.all_reduce(p.grad, group=mpu.get_sequence_parallel_group())
    result = {
        "logits": float((logits.detach() - whole.detach()[:, shard]).abs().max()),
        "grads": max(float((p.grad - want[n]).abs().max() / want[n].abs().max()) for n, p in model.named_parameters()),
    }
    print("RESULT " + json.dumps(result), flush=True)


@pytest.mark.slow
def test_a_sequence_split_over_two_gloo_ranks_gives_the_unsplit_logits_and_gradients(tiny_model_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    proc = subprocess.run(cmd + [str(tiny_model_dir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln[len("RESULT ") :] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 2, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for line in lines:
        result = json.loads(line)
        assert result["logits"] < 1e-5, result
        assert result["grads"] < 1e-5, result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    worker(sys.argv[1])
