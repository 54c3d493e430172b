"""The seed's PPO commands of workflows 1 and 2 (tests/helpers/seed_commands.py) run on the tiny
model through launch.local, on CPU: the command as ported (module name swapped), with only
what cannot exist here replaced, the substitutions listed below. Slow: each run starts vLLM,
DeepSpeed (ZeRO-3, bf16, as the command asks) and a critic.

What is replaced, and why:
- names of models and data on the hub (no hub here) -> the tiny model, a local chat dataset, a
  tiny reward model with a saved mean/std (workflow 1, ``--normalize_reward``) or a reward_func
  file (workflow 2);
- paths under /openrlhf -> the test's folder;
- sizes fit for 8x 80 GB GPUs -> 2 steps of 4 prompts;
- ``--vllm_sync_backend nccl`` -> gloo (no GPU; and colocated NCCL is refused on GPUs until the
  CUDA IPC backend exists, docs/colocated.md), and the engines' TP 2 -> 1 (2 cores).
Everything else -- colocation, both sleep flags, packing, gradient checkpointing, the critic --
runs as given; the flags that cannot act on CPU say so in the learner's log.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers.e2e_launch import cpu_env, local_cmd
from helpers.paths import HELPERS
from helpers.seed_commands import SEED_PPO_COMMANDS, argv, ported

pytestmark = pytest.mark.slow


def _tiny_reward_model(tiny: str, out) -> str:
    """A sequence classifier on the tiny model with a saved mean/std (what train_rm writes)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    rm.config.mean, rm.config.std = 0.0, 1.0
    rm.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return str(out)


def _chat_prompts(path) -> str:
    rows = [
        {"context_messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a in range(8)
        for b in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("workflow", sorted(SEED_PPO_COMMANDS))
def test_seed_command_runs_on_the_tiny_model(workflow, tmp_path, tiny_model_dir):
    tiny = str(tiny_model_dir)
    command = ported(SEED_PPO_COMMANDS[workflow])
    for hub_name, local in {
        "OpenRLHF/Llama-3-8b-sft-mixture": tiny,
        "OpenRLHF/prompt-collection-v0.1": _chat_prompts(tmp_path / "prompts.jsonl"),
        "/path/to/reward_func.py": str(HELPERS / "reward_first_char_parity.py"),
        "OpenRLHF/Llama-3-8b-rm-700k": (
            _tiny_reward_model(tiny, tmp_path / "rm") if "--reward_pretrain" in command else "unused"
        ),
    }.items():
        command = command.replace(hub_name, local)
    learner = argv(command) + [
        *("--save_path", str(tmp_path / "run" / "model"), "--ckpt_path", str(tmp_path / "ckpt")),
        *("--rollout_batch_size", "4", "--micro_rollout_batch_size", "4", "--train_batch_size", "4"),
        *("--micro_train_batch_size", "4", "--max_steps", "2", "--generate_max_len", "8", "--prompt_max_len", "64"),
        *("--vllm_sync_backend", "gloo"),
    ]
    rollout = "--dtype float32 --max_model_len 256 --tensor_parallel_size 1 --seed 0"
    cmd = local_cmd(tmp_path / "run", tiny, learner, rollout=rollout, reward=None, extra=["--quiet"])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(), timeout=900)
    run = tmp_path / "run"
    learner_log = (run / "logs" / "learner.log").read_text() if (run / "logs" / "learner.log").exists() else ""
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + learner_log[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("critic/value_loss" in r for r in steps), steps[-1].keys()  # gae: the critic trains
    assert "schedule: colocated" in learner_log
    for flag in ("vllm_enable_sleep", "deepspeed_enable_sleep", "vllm_gpu_memory_utilization"):
        assert learner_log.count(f"--{flag} cannot act here") == 1, flag
    assert (run / "model" / "config.json").exists()
