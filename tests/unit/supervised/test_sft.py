"""learner.train_sft end to end on the tiny model (CPU, DeepSpeed ZeRO-2): the loss on held-out
data falls far below the untrained loss, and a run killed -9 after a checkpoint and started
again (its newest checkpoint damaged on purpose) continues exactly as the uninterrupted run did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.procs import ROOT, python_cmd, read_log, run_module, worker_env
from helpers.wandb_offline import history, missing_from_history, offline_env, offline_runs, records, run_info
from learner.runtime.checkpoint import checkpoints, read_state


def test_help_is_fast_and_imports_no_torch():
    for module in ("learner.train_sft", "learner.train_rm", "learner.train_dpo"):
        t0 = time.time()
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=ROOT,
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "--pretrain" in out.stdout and "--save_steps" in out.stdout
        assert "--model.model_name_or_path" in out.stdout and "--ckpt.save_steps" in out.stdout  # both spellings
        assert time.time() - t0 < 5, f"{module} --help took {time.time() - t0:.1f}s"
    probe = (
        "import sys, learner.train_sft, learner.train_rm, learner.train_dpo; "
        "print('torch' in sys.modules or 'datasets' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "False"


def sft_args(model, data, save_path, *extra):
    return [
        "--pretrain",
        str(model),
        "--dataset",
        str(data / "sft_train.jsonl"),
        "--eval_dataset",
        str(data / "sft_eval.jsonl"),
        "--input_key",
        "input",
        "--output_key",
        "output",
        "--apply_chat_template",
        "--packing_samples",
        "--train_batch_size",
        "16",
        "--micro_train_batch_size",
        "8",
        "--learning_rate",
        "3e-3",
        "--max_epochs",
        "2",
        "--max_len",
        "64",
        "--zero_stage",
        "2",
        "--save_path",
        str(save_path),
        "--logging_steps",
        "1",
        *extra,
    ]


def _losses(records: list[dict]) -> dict[int, float]:
    steps = [r["step"] for r in records if "train/loss" in r]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


@pytest.mark.slow
def test_sft_learns_and_a_killed_run_resumes_to_the_same_losses(tiny_model_dir, tmp_path, monkeypatch):
    """An uninterrupted run learns; the same run SIGKILLed once its step-4 checkpoint is complete,
    its newest checkpoint then damaged (model states truncated), and started again with
    --load_checkpoint skips the damaged one with a warning, resumes the one before, and logs
    every step once with the uninterrupted run's loss, ending with its weights. Both log to wandb
    (offline): the run's history holds every record of train_log.jsonl, and the resumed run
    continues the wandb run its checkpoint names."""
    from learner.supervised.synthetic_data import write_all

    for k, v in offline_env(tmp_path / "wandb_home").items():
        monkeypatch.setenv(k, v)  # the trainers' processes inherit it (worker_env)
    data = tmp_path / "data"
    write_all(data, n_train=128, n_eval=64)
    flags = ["--eval_at_start", "--save_steps", "2", "--use_wandb", "True"]
    full = tmp_path / "full"
    run_module("learner.train_sft", sft_args(tiny_model_dir, data, full, *flags))
    log = read_log(full)
    evals = [r for r in log if "eval/loss" in r]
    before, after = evals[0]["eval/loss"], evals[-1]["eval/loss"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 16
    assert after < 0.25 * before, (before, after)  # measured: 7.10 -> ~0.8 nats per response token
    expected = _losses(log)
    assert sorted(expected) == list(range(1, 17))

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    proc = subprocess.Popen(
        python_cmd(["-m", "learner.train_sft", *sft_args(tiny_model_dir, data, run, *flags)]),
        cwd=ROOT,
        env=worker_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not (ckpts / "step_00000004" / "manifest.json").exists():
            assert proc.poll() is None, f"the run ended ({proc.returncode}) before its step-4 checkpoint"
            assert time.monotonic() < deadline, "no step-4 checkpoint within 300 s"
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before the kill"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    killed = [s for s, _ in checkpoints(ckpts)]
    k_newest = killed[-1]
    assert 4 <= k_newest < 16 and len(killed) >= 2, killed
    states = ckpts / f"step_{k_newest:08d}" / "model" / "ds" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:1000])
    saved_id = read_state(ckpts / f"step_{killed[-2]:08d}")["metrics"]["wandb"]["wandb_run_id"]

    out = run_module("learner.train_sft", sft_args(tiny_model_dir, data, run, *flags, "--load_checkpoint"))
    k = killed[-2]
    assert (
        f"skipping checkpoint {ckpts / f'step_{k_newest:08d}'}: it is damaged "
        f"(model/ds/mp_rank_00_model_states.pt has 1000 bytes, the manifest says" in out
    ), out[-3000:]
    assert f"resumed from {ckpts / f'step_{k:08d}'}: step {k}" in out, out[-3000:]
    got = _losses(read_log(run))  # the killed run's records after step k were dropped
    assert sorted(got) == list(range(1, 17))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-4, abs=1e-5), step
    assert [s for s, _ in checkpoints(ckpts)] == [12, 14, 16]  # --max_ckpt_num 3, the damaged one replaced
    (full_run,) = offline_runs(full)
    full_recs = records(full_run)
    assert missing_from_history(log, history(full_recs)) == []
    assert run_info(full_recs)["project"] == "rayless_train_sft"
    # The resumed run is the wandb run the checkpoint it resumed names (the killed run's offline
    # file may lack its last blocks: wandb writes it in blocks; metrics.jsonl has every record).
    assert run_info(records(offline_runs(run)[-1]))["run_id"] == saved_id

    import torch
    from safetensors.torch import load_file

    a, b = load_file(full / "model.safetensors"), load_file(run / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.slow
def test_sft_on_two_zero2_ranks_reduces_once_per_step_learns_and_resumes(tiny_model_dir, tmp_path):
    """Two gloo ranks at ZeRO-2, micro-batches of 4 in a global batch of 16: each rank
    accumulates 2, and on CPU the trainer reduces them once per optimizer step
    (``--coalesce_grad_reduction auto``); the model still learns. Its step-4 checkpoint (a ZeRO
    shard and an RNG file per rank, hashed by both ranks), named explicitly, resumes two ranks
    to the same losses."""
    from learner.supervised.synthetic_data import write_all

    data = tmp_path / "data"
    write_all(data, n_train=64, n_eval=32)
    save = tmp_path / "sft2"
    args = sft_args(tiny_model_dir, data, save, "--eval_at_start", "--save_steps", "4")
    args[args.index("--micro_train_batch_size") + 1] = "4"
    out = run_module("learner.train_sft", args, nproc=2)
    assert "sft: ZeRO-2 gradients reduced once per optimizer step, not after each of its 2 micro-batches" in out
    evals = [r for r in read_log(save) if "eval/loss" in r]
    assert evals[-1]["step"] == 8 and evals[-1]["eval/loss"] < 0.5 * evals[0]["eval/loss"], evals
    step4 = save / "checkpoints" / "step_00000004"
    files = json.loads((step4 / "manifest.json").read_text())["files"]
    assert {"rng/rank_0.pt", "rng/rank_1.pt"} <= set(files), sorted(files)
    assert sum("zero_pp_rank_" in name for name in files) >= 2, sorted(files)  # a shard per rank

    again = tmp_path / "again"
    rerun = [a if a != str(save) else str(again) for a in args]
    out = run_module("learner.train_sft", [*rerun, "--load_checkpoint", "--ckpt_path", str(step4)], nproc=2)
    assert f"resumed from {step4}: step 4" in out
    first, second = _losses(read_log(save)), _losses(read_log(again))
    assert sorted(second) == [5, 6, 7, 8]
    for step, loss in second.items():
        assert loss == pytest.approx(first[step], rel=1e-4, abs=1e-5), step
    assert [s for s, _ in checkpoints(save / "checkpoints")] == [4, 8]  # the resumed run saved 8 beside it
