"""Workflow 1 (SFT -> reward model -> PPO) on the tiny model: the SFT model is the RM's
starting point, and the RM it writes loads in plain transformers and in
our reward service with the same rewards, normalised by the mean/std the trainer wrote.

The PPO hop is the seed's workflow-1 command itself (learner.train_ppo, colocated, a critic,
--reward_pretrain this RM scored by the reward service), run as test_e2e_seed_commands.py runs
it, on the models trained here.
"""

from __future__ import annotations

import json

import pytest

from helpers.procs import read_log, run_module


@pytest.fixture(scope="module")
def workflow1_models(tiny_model_dir, tmp_path_factory):
    """Train SFT then RM on the synthetic addition data; returns a dict of paths."""
    from learner.supervised.synthetic_data import write_all

    root = tmp_path_factory.mktemp("workflow1")
    paths = {name: str(p) for name, p in write_all(root / "data", n_train=256, n_eval=64).items()}
    common = [
        "--apply_chat_template",
        "--train_batch_size",
        "16",
        "--micro_train_batch_size",
        "8",
        "--max_epochs",
        "1",
        "--max_len",
        "64",
        "--zero_stage",
        "2",
        "--logging_steps",
        "4",
        "--eval_at_start",
    ]
    sft, rm = root / "sft", root / "rm"
    run_module(
        "learner.train_sft",
        [
            "--pretrain",
            str(tiny_model_dir),
            "--dataset",
            paths["sft_train"],
            "--eval_dataset",
            paths["sft_eval"],
            "--input_key",
            "input",
            "--output_key",
            "output",
            "--learning_rate",
            "3e-3",
            "--save_path",
            str(sft),
            *common,
        ],
    )
    run_module(
        "learner.train_rm",
        [
            "--pretrain",
            str(sft),
            "--dataset",
            paths["pairs_train"],
            "--eval_dataset",
            paths["pairs_eval"],
            "--prompt_key",
            "prompt",
            "--chosen_key",
            "chosen",
            "--rejected_key",
            "rejected",
            "--learning_rate",
            "1e-3",
            "--save_path",
            str(rm),
            *common,
        ],
    )
    return {"sft": sft, "rm": rm, **paths}


@pytest.mark.slow
def test_sft_then_rm_learn(workflow1_models):
    sft_evals = [r["eval/loss"] for r in read_log(workflow1_models["sft"]) if "eval/loss" in r]
    assert sft_evals[-1] < 0.25 * sft_evals[0], sft_evals  # measured 7.10 -> 0.78
    rm_evals = [r for r in read_log(workflow1_models["rm"]) if "eval/acc" in r]
    # Half the eval pairs are learnable format errors, half arithmetic errors (near chance
    # for a 2-layer model), so ~75% is the expected ceiling of a short run.
    assert rm_evals[-1]["eval/acc"] >= 0.65, rm_evals  # measured 0.45 -> 0.73
    assert rm_evals[-1]["eval/reward_margin"] > rm_evals[0]["eval/reward_margin"] + 0.5


@pytest.mark.slow
def test_rm_loads_in_transformers_and_reward_service_with_its_mean_and_std(workflow1_models):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from learner.runtime.models import RewardModel

    rm_dir = workflow1_models["rm"]
    config = json.loads((rm_dir / "config.json").read_text())
    assert (
        config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    )  # num_labels = 1
    last_eval = [r for r in read_log(rm_dir) if "eval/reward_mean" in r][-1]
    assert config["mean"] == pytest.approx(last_eval["eval/reward_mean"])
    assert config["std"] == pytest.approx(last_eval["eval/reward_std"]) and config["std"] > 0

    tok = AutoTokenizer.from_pretrained(rm_dir)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=False
        ).rstrip()
        for q, a in [("What is 2 + 3?", "Answer: 5"), ("What is 2 + 3?", "lazy dog banana")]
    ]
    ids = [tok(t, add_special_tokens=False, return_tensors="pt")["input_ids"][0] for t in texts]
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = torch.stack([hf(input_ids=i[None]).logits[0, 0] for i in ids])  # transformers' own head
        ours = torch.stack([RewardModel(hf)(i[None], torch.ones(1, len(i), dtype=torch.long))[0] for i in ids])
    torch.testing.assert_close(plain, ours, atol=1e-5, rtol=1e-5)
    assert plain[0] > plain[1]  # the well-formed answer scores higher

    service = pytest.importorskip("reward_service.reward_model")
    scorer = service.RewardModelScorer.load(str(rm_dir), normalize=True)
    served = scorer.rewards(ids)
    expected = (plain - config["mean"]) / config["std"]
    torch.testing.assert_close(served, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_ppo_hop_is_the_seeds_command_on_the_trained_models(workflow1_models, tmp_path):
    """The seed's workflow 1, last hop: its PPO command as ported (test_e2e_seed_commands.py), from
    the SFT model with --reward_pretrain the trained RM and --normalize_reward. launch.local passes
    the RM (and the reference model, KL being on) to the reward service; the learner checks at
    start-up that a service scores with both."""
    from test_e2e_seed_commands import run_seed_command

    run, _, steps = run_seed_command("workflow1", tmp_path, str(workflow1_models["sft"]), str(workflow1_models["rm"]))
    first = (run / "logs" / "reward-0.log").read_text().splitlines()[0]
    assert f"--reward_pretrain {workflow1_models['rm']}" in first and "--ref_pretrain" in first, first
    # The trained RM's scores are real numbers (normalised by its mean/std), the KL term is live.
    assert all(r["rollout/reward"] == r["rollout/reward"] for r in steps)
    assert all(r["policy/kl_coef"] == 0.01 and "policy/kl_to_ref" in r for r in steps), steps[-1]
