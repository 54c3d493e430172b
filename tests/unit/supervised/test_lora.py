"""LoRA on the supervised trainers (``--ds.lora.rank`` / ``--lora_rank``, ``learner.runtime.lora``) on the tiny model.

The engine checks run this file as a worker script (a world of one, plain python; a process
group and DeepSpeed's globals live once per process): an optimizer step moves only the
adapters (and the reward model's score head), base weights bit-identical; the optimizer holds
only those; the saved merged model, loaded with plain transformers, gives the peft model's
outputs; a DeepSpeed checkpoint round trip restores the adapters and their optimizer state so
the next step is the same. The trainer runs (``learner.train_sft``/``train_rm``/``train_dpo``
with ``--lora_rank 8``) learn on the synthetic data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import procs
from helpers.procs import read_log, run_module

# --------------------------------------------------------------------------- fast tests


def test_bad_lora_flags_fail_naming_the_flag():
    from common.config import parse
    from learner.train_sft import SFTConfig

    base = ["--pretrain", "m", "--dataset", "d.jsonl"]
    for extra, match in [
        (["--lora_rank", "-1"], r"--ds.lora.rank \(--lora_rank\) must be >= 0"),
        (["--ds.lora.rank", "8", "--lora_alpha", "0"], r"--ds.lora.alpha \(--lora_alpha\) must be > 0"),
        (["--lora_rank", "8", "--ds.lora.dropout", "1.5"], r"--ds.lora.dropout \(--lora_dropout\) must be in"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse(SFTConfig, base + extra, raise_errors=True)
    lora = parse(SFTConfig, base + ["--lora_rank", "8"], raise_errors=True).ds.lora
    assert lora.rank == 8 and lora.target_modules == ["all-linear"] and lora.alpha == 16 and lora.dropout == 0.0
    cfg = parse(SFTConfig, base + ["--ds.lora.rank", "8", "--zero_stage", "3"], raise_errors=True)
    assert cfg.ds.zero_stage == 3 and cfg.ds.lora.rank == 8


def test_target_modules_naming_no_module_fails_naming_the_flag_and_named_ones_are_adapted(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from learner.runtime.flags import LoraSection
    from learner.runtime.lora import apply_lora

    lora = LoraSection(rank=4, alpha=16, dropout=0.0, target_modules=["no_such_proj"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match=r"^--ds.lora.target_modules no_such_proj: .*not found"):
        apply_lora(model, lora)
    lora.target_modules = ["q_proj", "v_proj"]  # named modules: only they are adapted
    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    adapted = {n.split(".")[-4] for n, p in peft_model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"}, adapted


# --------------------------------------------------------------------------- engines (worker)


@pytest.mark.slow
def test_lora_step_moves_only_adapters_merged_save_matches_and_checkpoint_resumes(tiny_model_dir, tmp_path):
    r = procs.run_worker(__file__, [str(tiny_model_dir), str(tmp_path)], timeout=300)
    for kind in ("sft_zero0", "sft_zero2_bf16", "rm"):
        k = r[kind]
        assert k["base_changed"] == [], (kind, k["base_changed"][:5])  # bit-identical base weights
        assert k["adapters_moved"] > 0 and k["adapters_unmoved"] == [], kind
        assert k["optimizer_params"] == k["trainable"] < k["total"] // 10, kind  # only adapters optimized
    assert r["rm"]["head_moved"]  # the score head trains in full
    for kind in ("sft_zero0", "rm"):
        assert r[kind]["merged_max_diff"] < 1e-5, r[kind]  # plain transformers = the peft model, fp32
        assert r[kind]["adapter_saved"]
    assert r["sft_zero0"]["resume_max_diff"] == 0.0 and r["sft_zero0"]["resume_optimizer_equal"], r["sft_zero0"]


# --------------------------------------------------------------------------- trainer runs


def _common(model, save, lr: str, *extra: str) -> list[str]:
    return [
        "--pretrain",
        str(model),
        "--apply_chat_template",
        "--train_batch_size",
        "16",
        "--micro_train_batch_size",
        "8",
        "--learning_rate",
        lr,
        "--max_epochs",
        "1",
        "--max_len",
        "64",
        "--save_path",
        str(save),
        "--eval_at_start",
        "--logging_steps",
        "4",
        "--lora_rank",
        "8",
        *extra,
    ]


def _pairs(paths) -> list[str]:
    # OpenRLHF 0.10's dotted names beside _common's flat ones: the two spellings mix in one command
    return [
        "--data.dataset",
        str(paths["pairs_train"]),
        "--eval.dataset",
        str(paths["pairs_eval"]),
        "--data.prompt_key",
        "prompt",
        "--data.chosen_key",
        "chosen",
        "--data.rejected_key",
        "rejected",
    ]


def _evals(save, key: str) -> list[float]:
    return [r[key] for r in read_log(save) if key in r]


@pytest.mark.slow
def test_sft_with_lora_learns_and_saves_a_plain_model_and_its_adapter(tiny_model_dir, tmp_path):
    """Two ranks under ZeRO-3 (the base and the adapters partitioned; one rank at ZeRO-0/2 is the
    engine test's above): the run learns, saves the merged model and the adapter (gathered on
    both ranks), and its step-4 checkpoint resumes two ranks to the same step 8."""
    from learner.supervised.synthetic_data import write_all

    paths = write_all(tmp_path / "data", n_train=128, n_eval=32)
    save = tmp_path / "sft"
    data = ["--dataset", str(paths["sft_train"]), "--eval_dataset", str(paths["sft_eval"])]
    data += ["--input_key", "input", "--output_key", "output", "--packing_samples", "--gradient_checkpointing"]
    args = _common(tiny_model_dir, save, "1e-2", *data, "--save_steps", "4", "--zero_stage", "3")
    out = run_module("learner.train_sft", args, nproc=2)
    assert "LoRA rank 8 alpha 16" in out
    losses = _evals(save, "eval/loss")
    assert losses[-1] < 0.5 * losses[0], losses  # measured: 7.07 -> 1.35 in 8 steps (docs/trainers.md)
    assert (save / "model.safetensors").is_file() and (save / "adapter" / "adapter_model.safetensors").is_file()

    import torch
    from safetensors.torch import load_file

    assert not any("lora" in k for k in load_file(save / "model.safetensors")), "the saved model is merged"

    # Resumed from its step-4 checkpoint (adapters, their Adam state, the LR schedule), the run
    # logs steps 5-8 with the first run's losses and ends with its weights.
    step4 = save / "checkpoints" / "step_00000004"
    again = tmp_path / "again"
    rerun = [a if a != str(save) else str(again) for a in args]
    out = run_module("learner.train_sft", [*rerun, "--load_checkpoint", "--ckpt_path", str(step4)], nproc=2)
    assert f"resumed from {step4}: step 4" in out
    first = {r["step"]: r["train/loss"] for r in read_log(save) if "train/loss" in r}
    second = {r["step"]: r["train/loss"] for r in read_log(again) if "train/loss" in r}
    assert sorted(second) == [8] and second[8] == pytest.approx(first[8], rel=1e-5), (first, second)
    a, b = load_file(save / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Other LoRA settings cannot resume it, and say so before the model loads.
    with pytest.raises(AssertionError, match="lora_rank: checkpoint 8, this run 4"):
        run_module("learner.train_sft", [*rerun, "--lora_rank", "4", "--load_checkpoint", "--ckpt_path", str(step4)])


@pytest.mark.slow
def test_rm_with_lora_raises_accuracy(tiny_model_dir, tmp_path):
    from learner.supervised.synthetic_data import write_all

    paths = write_all(tmp_path / "data", n_train=128, n_eval=32)
    save = tmp_path / "rm"
    run_module("learner.train_rm", _common(tiny_model_dir, save, "1e-2", *_pairs(paths)))
    acc = _evals(save, "eval/acc")
    assert acc[-1] > acc[0] + 0.1, acc  # measured: 0.47 -> 0.75 (the format pairs)


@pytest.mark.slow
def test_dpo_with_lora_raises_the_margin(tiny_model_dir, tmp_path):
    from learner.supervised.synthetic_data import write_all

    paths = write_all(tmp_path / "data", n_train=128, n_eval=32)
    save = tmp_path / "dpo"
    run_module("learner.train_dpo", _common(tiny_model_dir, save, "1e-2", *_pairs(paths), "--beta", "0.1"))
    margins = _evals(save, "eval/reward_margin")
    assert margins[0] == pytest.approx(0.0, abs=1e-4) and margins[-1] > 0.2, margins  # measured: 0 -> 1.17


def _snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _step_report(engine, before) -> dict:
    import torch

    from common.weights.source import unwrap

    module = unwrap(engine)
    after = dict(module.named_parameters())
    trainable = {n for n, p in after.items() if p.requires_grad}
    changed = {n for n, p in after.items() if not torch.equal(p.detach(), before[n])}
    return {
        "base_changed": sorted(changed - trainable),
        "adapters_moved": len(changed & trainable),
        "adapters_unmoved": sorted(n for n in trainable - changed if "lora_A" not in n),  # A may stay with B = 0
        "head_moved": any("modules_to_save" in n for n in changed),
        "trainable": sum(after[n].numel() for n in trainable),
        "total": sum(p.numel() for p in after.values()),
        "optimizer_params": sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]),
    }


def _engine(model, *, bf16=False, zero_stage=0):
    from learner.runtime import engine as E

    return E.make_engine(
        model,
        zero_stage=zero_stage,
        bf16=bf16,
        train_batch_size=2,
        micro_train_batch_size=2,
        learning_rate=1e-2,
        num_training_steps=10,
        lr_scheduler="constant_with_warmup",
        lr_warmup_ratio=0.0,
    )


def _lora():
    from learner.runtime.flags import LoraSection

    return LoraSection(rank=8, alpha=16, dropout=0.0, target_modules=["all-linear"])


def _sft_step(engine, batch):
    engine.backward(engine(**batch, labels=batch["input_ids"], use_cache=False).loss)
    engine.step()


def _worker(model_dir: str, out: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from common.weights.source import unwrap
    from learner.algorithms.kl import last_token_index
    from learner.runtime import engine as E
    from learner.runtime.lora import apply_lora
    from learner.runtime.models import load_reward_model

    E.init_distributed()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    batch = tok(["What is 2 + 3? Answer: 5", "What is 7 + 1? Answer: 8"], return_tensors="pt", padding=True)
    result = {}

    # SFT, fp32 (one rank: stage 0), gradient checkpointing on a frozen base
    model = apply_lora(E.load_causal_lm(model_dir, gradient_checkpointing=True), _lora(), gradient_checkpointing=True)
    eng = _engine(model)
    before = _snapshot(unwrap(eng))
    _sft_step(eng, batch)
    r = _step_report(eng, before)
    E.save_hf(eng, tok, Path(out) / "sft")
    plain = AutoModelForCausalLM.from_pretrained(Path(out) / "sft", dtype=torch.float32)
    eng.eval()
    with torch.no_grad():
        ours = eng(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        theirs = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    r["merged_max_diff"] = (ours - theirs).abs().max().item()
    r["adapter_saved"] = (Path(out) / "sft" / "adapter" / "adapter_config.json").is_file()
    eng.train()
    # Checkpoint round trip: a second engine loaded from it takes the same next step.
    E.save_checkpoint(eng, Path(out) / "ckpt", tag="step1")
    again = _engine(
        apply_lora(E.load_causal_lm(model_dir, gradient_checkpointing=True), _lora(), gradient_checkpointing=True)
    )
    E.load_checkpoint(again, Path(out) / "ckpt")
    s1, s2 = eng.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    r["resume_optimizer_equal"] = s1.keys() == s2.keys() and all(
        torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) and torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"])
        for k in s1
    )
    _sft_step(eng, batch)
    _sft_step(again, batch)
    a, b = dict(unwrap(eng).named_parameters()), dict(unwrap(again).named_parameters())
    r["resume_max_diff"] = max((a[n] - b[n]).abs().max().item() for n in a)
    result["sft_zero0"] = r

    # SFT, bf16 at ZeRO-2 (kept at stage 2 with one rank)
    model = apply_lora(E.load_causal_lm(model_dir, zero_stage=2, bf16=True), _lora())
    eng = _engine(model, bf16=True, zero_stage=2)
    before = _snapshot(unwrap(eng))
    _sft_step(eng, batch)
    result["sft_zero2_bf16"] = _step_report(eng, before)

    # RM: adapters and the score head
    rm = apply_lora(load_reward_model(model_dir, tokenizer=tok), _lora())
    eng = _engine(rm)
    before = _snapshot(unwrap(eng))
    rewards = eng(batch["input_ids"], batch["attention_mask"])
    eng.backward(-torch.nn.functional.logsigmoid(rewards[0] - rewards[1]))
    eng.step()
    r = _step_report(eng, before)
    E.save_hf(eng, tok, Path(out) / "rm")
    plain = AutoModelForSequenceClassification.from_pretrained(Path(out) / "rm", dtype=torch.float32)
    with torch.no_grad():
        ours = eng(batch["input_ids"], batch["attention_mask"])
        hidden = plain.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        last = last_token_index(batch["attention_mask"])
        theirs = plain.score(hidden[torch.arange(2), last]).squeeze(-1)
    r["merged_max_diff"] = (ours - theirs).abs().max().item()
    r["adapter_saved"] = (Path(out) / "rm" / "adapter" / "adapter_config.json").is_file()
    result["rm"] = r
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(_worker(sys.argv[1], sys.argv[2])), flush=True)
