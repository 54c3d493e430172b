"""End to end: the sequence split (``--ds.ring_attn_size 2``) through launch.local with real vLLM, the
reward service and DeepSpeed: 2 learner ranks, one sequence-parallel group, joining the session's
shared fleet (slow).

What only a real run shows: the learner's split log-probs of vLLM's own samples agree with vLLM's
sampling log-probs (``rollout/logprob_diff``, ~1e-6 in fp32 when each token sees exactly its own
sample's tokens; a mask crossing packed samples or a shard's columns misplaced moves it by orders of
magnitude), the weights trained split reach the fleet (the next step's samples are scored by the
same weights: the diff stays small after updates), and the batch arithmetic of 2 ranks that are
one data-parallel rank (a micro-batch of the whole train batch, which unsplit 2 ranks would refuse).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.e2e_launch import finish, local_cmd, metrics, start

pytestmark = pytest.mark.slow


def test_grpo_with_the_sequence_split_over_two_learner_ranks(tmp_path: Path, tiny_model_dir, shared_fleet):
    from launch.demo_task import problems, write_jsonl

    steps = 2
    train, _ = problems(0)
    prompts = write_jsonl(train, tmp_path / "prompts.jsonl")
    learner = [
        *("--prompt_data", str(prompts), "--input_key", "input", "--n_samples_per_prompt", "4"),
        *("--rollout_batch_size", "8", "--train_batch_size", "32", "--micro_train_batch_size", "32"),
        *("--micro_rollout_batch_size", "32", "--max_steps", str(steps), "--generate_max_len", "8"),
        *("--actor_learning_rate", "3e-3", "--init_kl_coef", "0", "--zero_stage", "2", "--seed", "0"),
        *("--packing_samples", "--ring_attn_size", "2", "--peer_timeout_s", "5"),
    ]
    proc = start(
        local_cmd(tmp_path / "run", tiny_model_dir, learner, fleet=shared_fleet, extra=["--learner_nproc", "2"])
    )
    out = finish(proc, 600)
    assert proc.returncode == 0, out[-4000:]
    rows = [m for m in metrics(tmp_path / "run") if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, steps + 1)), out[-4000:]
    # fp32 on both sides; the second step's samples come from the weights the first step trained split
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in rows), [m["rollout/logprob_diff"] for m in rows]
    assert all(m["policy/actor_updated"] == 1.0 for m in rows)
