"""common/vllm_memory.py: the CPU share chosen from what the engine needs, vLLM-CPU's start-up
check mirrored on hand-computed numbers (the issue's own among them), and the node read as vLLM
reads it. No engine is started here; the real starts are in tests/unit/rollout_service."""

from __future__ import annotations

import math

import pytest

from common.vllm_memory import (
    DEFAULT_CPU_KV_BYTES,
    GIB,
    KV_SPACE_ENV,
    RUNTIME_BYTES,
    EngineNeed,
    EngineStartRefused,
    NodeMemory,
    engine_need,
    kv_space_bytes,
    node_memory,
    refusal,
    share_of,
    weights_bytes,
)

FLAG = "--gpu_memory_utilization"


def gib(x: float) -> int:
    return int(x * GIB)


def test_the_issues_refusal_becomes_one_line_with_a_share_that_starts():
    # Node 0: 12.71 GiB, 9.15 GiB free; 0.85 asks for ceil(0.85 * 12.71 GiB) = 10.80 GiB > 9.15.
    # The largest share in hundredths that fits: floor(100 * 9.15 / 12.71) / 100 = floor(71.99) / 100
    # = 0.71. This engine needs 2.5 GiB: ceil(100 * 2.5 / 12.71) / 100 = ceil(19.67) / 100 = 0.20.
    mem = NodeMemory(node=0, total=gib(12.71), available=gib(9.15))
    line = refusal(0.85, mem, flag=FLAG, who="rollout-0", need=gib(2.5))
    assert line == (
        "rollout-0: vLLM-CPU will not start: --gpu_memory_utilization 0.85 asks for 10.80 GiB of NUMA node 0 "
        "(12.71 GiB) to be free and 9.15 GiB is: pass --gpu_memory_utilization 0.71 (this engine needs about "
        "0.20), or free memory on node 0"
    )
    assert "\n" not in line
    assert refusal(0.71, mem, flag=FLAG, who="rollout-0", need=gib(2.5)) is None  # the advice holds
    assert refusal(0.72, mem, flag=FLAG, who="rollout-0", need=gib(2.5)) is not None  # and is the largest


def test_the_check_is_vllms_ceil_of_total_times_share_against_available():
    mem = NodeMemory(node=1, total=1000, available=500)
    assert refusal(0.5, mem, flag=FLAG, who="w") is None  # ceil(500.0) = 500 <= 500
    assert refusal(0.501, mem, flag=FLAG, who="w") is not None  # ceil(501.0) = 501 > 500


def test_when_no_share_fits_what_the_engine_needs_it_says_what_would_help():
    # 1 GiB free of 12 GiB: every share that holds the engine's 3 GiB (0.25) asks for more.
    mem = NodeMemory(node=0, total=gib(12), available=gib(1))
    line = refusal(0.25, mem, flag="--ref_gpu_memory_utilization", who="reward-0", need=gib(3))
    assert line.startswith("reward-0: vLLM-CPU will not start: --ref_gpu_memory_utilization 0.25 asks for 3.00 GiB")
    assert "less than this engine needs (3.00 GiB): free memory on node 0, or set VLLM_CPU_KVCACHE_SPACE" in line


def test_the_share_is_rounded_up_to_the_hundredth_and_at_most_1():
    assert share_of(gib(2.5), gib(12.71)) == 0.20  # 19.67 % -> 0.20
    assert share_of(gib(3), gib(12)) == 0.25  # exactly 25 %: not rounded past it
    assert share_of(gib(20), gib(12)) == 1.0  # vLLM refuses more than 1; the check then says why


def test_the_kv_cache_size_is_read_as_vllm_reads_it():
    # vllm/platforms/cpu.py: set -> that many GiB; unset -> sized from the share.
    assert kv_space_bytes({KV_SPACE_ENV: "3"}) == 3 * GIB and kv_space_bytes({}) is None
    # vllm.envs reads it with int() in every worker: an empty or fractional value kills them.
    for bad in ("", "1.5"):
        with pytest.raises(EngineStartRefused, match=f"VLLM_CPU_KVCACHE_SPACE={bad!r} is not a whole number"):
            kv_space_bytes({KV_SPACE_ENV: bad})
    need = engine_need("/nonexistent-model", {})
    assert (need.kv, need.runtime, need.weights_known) == (DEFAULT_CPU_KV_BYTES, RUNTIME_BYTES, False)
    assert engine_need("/nonexistent-model", {KV_SPACE_ENV: "2"}).kv == 2 * GIB


def test_weights_are_the_checkpoints_weight_files(tiny_model_dir):
    files = sorted(tiny_model_dir.glob("*.safetensors"))
    assert files and weights_bytes(str(tiny_model_dir)) == sum(p.stat().st_size for p in files)
    need = engine_need(str(tiny_model_dir), {KV_SPACE_ENV: "1"})
    assert need.total == need.weights + GIB + RUNTIME_BYTES
    assert str(EngineNeed(weights=GIB // 2, kv=GIB, kv_from=KV_SPACE_ENV)) == (
        "weights 0.50 + KV cache 1.00 (VLLM_CPU_KVCACHE_SPACE) + runtime 1.00 = 2.50 GiB"
    )


def test_the_node_is_read_with_vllms_own_functions():
    pytest.importorskip("vllm")
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    mem = node_memory()
    info = get_memory_node_info(mem.node)
    assert mem.total == info.total_memory
    # Free memory moves between the two readings (other processes run); the total does not.
    assert math.isclose(mem.available, info.available_memory, rel_tol=0.05)
    assert 0 < mem.available < mem.total
