"""``python -m learner.lora_combine``: a base model + a LoRA adapter -> one plain HF model whose
outputs equal the PeftModel's, for a causal LM and for a reward model (its score head trained
through the adapter, as rayless's RM trainer does). The adapters are built with
``learner.runtime.lora.apply_lora``, the trainers' own, and their B matrices drawn nonzero (peft
starts B at 0, which would make any merge look right)."""

import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from helpers.procs import ROOT, run_module
from learner.lora_combine import CombineError, combine, parse_config
from learner.runtime.flags import LoraSection
from learner.runtime.lora import apply_lora, save_lora_hf
from learner.runtime.models import RewardModel
from reward_service.reward_model import RewardModelScorer

LORA = LoraSection(rank=8, alpha=16, target_modules=["all-linear"], dropout=0.0)


def trained_looking(model, seed=0, scale=0.05):
    """LoRA B (and any modules_to_save copy, e.g. a reward head) drawn nonzero, in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name or ".modules_to_save." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def batch(seed=0, vocab=700):
    """Right-padded ids and mask, (3, 17), rows of 17, 9 and 4 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 17), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = mask[2, 4:] = 0
    return ids * mask, mask


@pytest.fixture(scope="module")
def causal_adapter(tiny_model_dir, tmp_path_factory):
    """(PeftModel of the tiny causal LM, its adapter folder as peft saves it)."""
    peft = trained_looking(apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LORA))
    out = tmp_path_factory.mktemp("lora") / "adapter"
    peft.save_pretrained(out)
    return peft, out


def test_help_is_instant_and_bf16_is_the_flat_spelling():
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "learner.lora_combine", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "--lora_path" in out.stdout and "--ds.param_dtype" in out.stdout
    assert time.monotonic() - t0 < 2.0
    args = ["--model_path", "b", "--lora_path", "l", "--output_path", "o"]
    assert parse_config([*args, "--bf16"]).ds.param_dtype == "bf16"
    assert parse_config(args).ds.param_dtype == "auto" and not parse_config(args).is_rm


def test_causal_lm_merged_logits_equal_the_peft_models(causal_adapter, tiny_model_dir, tmp_path):
    peft, adapter = causal_adapter
    out = tmp_path / "merged"
    args = ["--model_path", str(tiny_model_dir), "--lora_path", str(adapter), "--output_path", str(out)]
    run_module("learner.lora_combine", [*args, "--ds.param_dtype", "fp32"], timeout=300)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids, mask = batch()
    with torch.no_grad():
        want = peft(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        got = merged(input_ids=ids, attention_mask=mask).logits
        before = base(input_ids=ids, attention_mask=mask).logits
    assert (got - want).abs().max().item() < 1e-5
    assert (before - want).abs().max().item() > 1e-3  # the adapter moved the logits: the check has teeth
    assert not [k for k in merged.state_dict() if "lora" in k]
    assert AutoTokenizer.from_pretrained(out).vocab_size == AutoTokenizer.from_pretrained(tiny_model_dir).vocab_size


def test_param_dtype_sets_the_saved_dtype_and_an_existing_output_is_refused(causal_adapter, tiny_model_dir, tmp_path):
    _, adapter = causal_adapter
    out = combine(str(tiny_model_dir), adapter, tmp_path / "bf16", param_dtype="bf16")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    with pytest.raises(CombineError, match="--output_path .* exists"):
        combine(str(tiny_model_dir), adapter, out)
    with pytest.raises(CombineError, match="no adapter_config.json"):
        combine(str(tiny_model_dir), tmp_path, tmp_path / "none")


def test_reward_model_merged_with_its_head_scores_as_the_peft_model(tiny_model_dir, tmp_path):
    # as the RM trainer builds it: a causal LM's backbone, a new score head, LoRA with the head
    # trained in full (modules_to_save), saved as save_lora_hf does (the adapter in ckpt/adapter)
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    rm = trained_looking(apply_lora(RewardModel(hf), LORA), seed=1)
    ckpt = tmp_path / "rm_ckpt"
    save_lora_hf(rm.hf_model, None, ckpt)
    out = combine(str(tiny_model_dir), ckpt, tmp_path / "rm_merged", is_rm=True, param_dtype="fp32")
    merged = RewardModel(AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)).eval()
    ids, mask = batch(seed=2)
    with torch.no_grad():
        want = rm(ids, mask)  # (B,)
        got = merged(ids, mask)
    assert (got - want).abs().max().item() < 1e-5, (got, want)
    assert want.std() > 1e-3
    # and the reward service reads the merged model as it is
    served = RewardModelScorer.load(str(out)).rewards([row[m.bool()] for row, m in zip(ids, mask, strict=True)])
    assert (served - want).abs().max().item() < 1e-5


def test_reward_model_without_a_head_anywhere_is_refused(causal_adapter, tiny_model_dir, tmp_path):
    _, adapter = causal_adapter  # trained on the causal LM: no score head in it or in the base
    with pytest.raises(CombineError, match="score.weight"):
        combine(str(tiny_model_dir), adapter, tmp_path / "rm", is_rm=True)
    assert not (tmp_path / "rm").exists()
