"""The seed's PPO commands of workflows 1 and 2 (tests/helpers/seed_commands.py) run through
launch.local, on CPU (workflow 2 here on the tiny model; workflow 1 in test_workflow1.py, as the
last hop after the SFT and reward-model hops, on the models they trained): the command as ported (module name swapped), with only
what cannot exist here replaced, the substitutions listed below. Slow: each run starts vLLM,
DeepSpeed (ZeRO-3, bf16, as the command asks) and a critic.

What is replaced, and why:
- names of models and data on the hub (no hub here) -> the tiny model (workflow 1: the SFT model
  trained from it), a local chat dataset, the reward model trained there with its saved
  mean/std (workflow 1, ``--normalize_reward``) or a reward_func file (workflow 2);
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


def run_seed_command(workflow: str, tmp_path, policy: str, reward_model: str | None = None):
    """Runs a seed PPO command, ported, through launch.local and checks what every seed run must
    do; returns (run folder, the learner's log, the metrics of each step). ``policy`` and
    ``reward_model`` stand in for the hub's SFT and reward models (``reward_model`` default: a
    reward model made here from ``policy``)."""
    command = ported(SEED_PPO_COMMANDS[workflow])
    if reward_model is None and "--reward_pretrain" in command:
        reward_model = _tiny_reward_model(policy, tmp_path / "rm")
    for hub_name, local in {
        "OpenRLHF/Llama-3-8b-sft-mixture": policy,
        "OpenRLHF/prompt-collection-v0.1": _chat_prompts(tmp_path / "prompts.jsonl"),
        "/path/to/reward_func.py": str(HELPERS / "reward_first_char_parity.py"),
        "OpenRLHF/Llama-3-8b-rm-700k": reward_model or "unused",
    }.items():
        command = command.replace(hub_name, local)
    learner = argv(command) + [
        *("--save_path", str(tmp_path / "run" / "model"), "--ckpt_path", str(tmp_path / "ckpt")),
        *("--rollout_batch_size", "4", "--micro_rollout_batch_size", "4", "--train_batch_size", "4"),
        *("--micro_train_batch_size", "4", "--max_steps", "2", "--generate_max_len", "8", "--prompt_max_len", "64"),
        *("--vllm_sync_backend", "gloo"),
    ]
    rollout = "--dtype float32 --max_model_len 256 --tensor_parallel_size 1 --seed 0"
    cmd = local_cmd(tmp_path / "run", policy, learner, rollout=rollout, reward=None, extra=["--quiet"])
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
    return run, learner_log, steps


def test_seed_workflow2_command_runs_on_the_tiny_model(tmp_path, tiny_model_dir):
    """Workflow 2 (a reward_func file). Workflow 1's command runs in test_workflow1.py, on the
    SFT and reward models that workflow's earlier hops trained."""
    run_seed_command("workflow2", tmp_path, str(tiny_model_dir))
