"""The GPU-only flags (``learner.runtime.gpu_features``): ``--ds.use_liger_kernel``,
``--ds.load_in_4bit`` (QLoRA), ``--ds.deepcompile``, and ``--ds.attn_implementation
flash_attention_2`` (``learner.runtime.engine.attn_implementation``).

On CPU each given flag does nothing and is said once, in one line: the fast tests ask the plan
(and what it would do on ``cuda``, without a GPU), a slow one runs the real loaders and engines
through ``model_options`` / ``engine_options`` as every trainer does. The ``gpu`` tests load the
tiny model with each flag on one GPU and train a step, each in its own process:
``python tests/unit/runtime/test_gpu_features.py WHAT MODEL_DIR OUT_DIR`` prints ``RESULT {json}``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys

import pytest

from helpers import procs

ALL = dict(use_liger_kernel=True, load_in_4bit=True, deepcompile=True)


def run_worker(args: list[str], *, timeout: float = 600) -> dict:
    return procs.run_worker(__file__, args, timeout=timeout)


# --------------------------------------------------------------------------- fast tests


def test_on_cpu_the_plan_does_nothing_and_says_why_once_per_flag():
    from learner.runtime.gpu_features import GpuPlan, gpu_plan

    plan = gpu_plan("cpu", **ALL)
    assert (plan.liger, plan.bnb_4bit, plan.ds_config, plan.compile) == (False, None, {}, False)
    assert plan.notices == (
        "--ds.use_liger_kernel: Liger's kernels are Triton GPU kernels; this learner runs on CPU, so the model is "
        "loaded without them",
        "--ds.load_in_4bit: QLoRA's 4-bit base saves GPU memory through bitsandbytes' CUDA kernels; this learner "
        "runs on CPU, so the base model loads in float32 and the LoRA adapters train on it unquantized",
        "--ds.deepcompile: DeepCompile's compiler passes run only on CUDA (DeepSpeed's is_deepcompile_supported); "
        "this learner runs on CPU, so the engine runs eagerly",
    )
    assert "loads in bfloat16" in gpu_plan("cpu", load_in_4bit=True, bf16=True).notices[0]
    assert gpu_plan("cpu") == GpuPlan()  # nothing given: nothing said
    # a device DeepSpeed names otherwise (xpu, mps ...) is told by its name
    assert "runs on xpu" in gpu_plan("xpu:0", use_liger_kernel=True).notices[0]


def test_on_cuda_the_plan_gives_the_loader_keywords_and_the_deepspeed_config():
    from learner.runtime.gpu_features import gpu_plan

    have = lambda module: object()  # noqa: E731 -- the packages, as a GPU host with the gpu extra has them
    plan = gpu_plan("cuda:1", **ALL, bf16=True, zero_stage=2, find_spec=have)
    assert plan.notices == ()
    assert plan.liger
    # QLoRA's NF4 with double quantization (OpenRLHF's), computing in the training dtype
    assert plan.bnb_4bit == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "bfloat16",
    }
    assert plan.ds_config == {"compile": {"deepcompile": True}} and plan.compile  # DeepSpeed 0.19's key
    # ZeRO-3 partitions and casts every parameter: the packed weights are stored in the training dtype
    z3 = gpu_plan("cuda", load_in_4bit=True, zero_stage=3, find_spec=have)
    assert z3.bnb_4bit is not None and z3.bnb_4bit["bnb_4bit_quant_storage"] == "float32"
    assert z3.bnb_4bit["bnb_4bit_compute_dtype"] == "float32" and not z3.liger and not z3.compile
    assert gpu_plan("cuda", find_spec=have) == gpu_plan("cpu")  # nothing given: nothing added


def test_on_cuda_a_missing_package_is_refused_naming_the_extra():
    from learner.runtime.gpu_features import gpu_plan

    for flag, package in (("use_liger_kernel", "liger-kernel"), ("load_in_4bit", "bitsandbytes")):
        with pytest.raises(RuntimeError, match=rf"--ds.{flag} needs the {package} package .*pip install -e '.\[gpu\]'"):
            gpu_plan("cuda", **{flag: True}, find_spec=lambda module: None)
    gpu_plan("cuda", deepcompile=True, find_spec=lambda module: None)  # DeepSpeed's own: nothing more to install


def test_the_4bit_plan_becomes_a_bitsandbytes_config():
    import torch

    from learner.runtime.gpu_features import from_pretrained_kwargs, gpu_plan

    plan = gpu_plan("cuda", load_in_4bit=True, bf16=True, zero_stage=3, find_spec=lambda m: object())
    q = from_pretrained_kwargs(plan)["quantization_config"]
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16 and q.bnb_4bit_quant_storage == torch.bfloat16
    assert from_pretrained_kwargs(gpu_plan("cpu", load_in_4bit=True)) == {}


def test_announce_says_each_notice_once_per_process(monkeypatch, caplog):
    from learner.runtime import gpu_features as G

    monkeypatch.setattr(G, "_said", set())
    with caplog.at_level(logging.WARNING, logger="rayless.gpu_features"):
        for _ in range(3):  # actor, critic, reference: the same flags
            G.announce(G.gpu_plan("cpu", **ALL))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--ds.use_liger_kernel",
        "--ds.load_in_4bit",
        "--ds.deepcompile",
    ]


def _configs():
    from common.config import build
    from learner.rl.config import PPOConfig
    from learner.train_dpo import DPOConfig
    from learner.train_rm import RMConfig
    from learner.train_sft import SFTConfig

    ppo = dict(pretrain="m", prompt_data="p", rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8)
    return {
        "sft": lambda **kw: build(SFTConfig, pretrain="m", dataset="d", **kw),
        "rm": lambda **kw: build(RMConfig, pretrain="m", dataset="d", **kw),
        "dpo": lambda **kw: build(DPOConfig, pretrain="m", dataset="d", **kw),
        "ppo": lambda **kw: build(PPOConfig, **ppo, micro_train_batch_size=2, **kw),
    }


@pytest.mark.parametrize("trainer", ["sft", "rm", "dpo", "ppo"])
def test_every_trainer_refuses_4bit_without_lora_and_passes_the_flags_to_its_loaders(trainer):
    from common.config import parse
    from learner.runtime.flags import OptimizerFields, engine_options, model_options

    make = _configs()[trainer]
    with pytest.raises(ValueError, match=r"--ds.load_in_4bit \(--load_in_4bit\) is QLoRA.*--ds.lora.rank"):
        make(load_in_4bit=True)
    cfg = make(load_in_4bit=True, use_liger_kernel=True, deepcompile=True, lora_rank=8)
    # built, no longer inert: nothing said at parse time (the device decides, at load)
    assert not [n for n in cfg.notices if "liger" in n or "4bit" in n or "deepcompile" in n]
    loads = model_options(cfg.ds, gradient_checkpointing=False)
    assert loads["use_liger_kernel"] and loads["load_in_4bit"]
    optim = cfg.actor if trainer == "ppo" else cfg  # train_ppo's actor and critic share ds
    assert isinstance(optim, OptimizerFields) and engine_options(cfg.ds, optim)["deepcompile"]
    # both spellings, OpenRLHF 0.10's dotted and the older flat one
    module = {"sft": "train_sft", "rm": "train_rm", "dpo": "train_dpo"}.get(trainer)
    if module is not None:
        cls = type(cfg)
        argv = ["--pretrain", "m", "--dataset", "d", "--lora_rank", "4"]
        dotted = parse(
            cls, [*argv, "--ds.load_in_4bit", "--ds.use_liger_kernel", "--ds.deepcompile"], raise_errors=True
        )
        flat = parse(cls, [*argv, "--load_in_4bit", "--use_liger_kernel", "--deepcompile"], raise_errors=True)
        assert dotted.ds == flat.ds and flat.ds.load_in_4bit and flat.ds.use_liger_kernel and flat.ds.deepcompile


@pytest.mark.slow
def test_on_cpu_the_loaders_and_engines_say_each_flag_once_and_train_as_without(tiny_model_dir, tmp_path):
    """Through ``model_options`` / ``engine_options`` as the trainers call them: a policy (LoRA),
    a reward model and a second engine (train_ppo's critic) with all three flags. Each is said in
    one line, once; the models load in full precision, unpatched, and the engines run eagerly."""
    r = run_worker(["cpu", str(tiny_model_dir), str(tmp_path)])
    assert [line.split(":")[0] for line in r["said"]] == [
        "--ds.use_liger_kernel",
        "--ds.load_in_4bit",
        "--ds.deepcompile",
    ], r["said"]
    assert r["quantized"] == 0 and not r["quant_config"] and not r["liger"]
    assert not r["compiled"] and "compile" not in r["ds_config"]
    assert math.isfinite(r["loss"]) and r["moved"] > 0


# --------------------------------------------------------------------------- GPU tests


@pytest.mark.gpu
def test_liger_kernels_patch_the_policy_and_the_reward_model_and_train(tiny_model_dir, tmp_path):
    r = run_worker(["liger", str(tiny_model_dir), str(tmp_path)])
    assert r["patched"] and r["rm_patched"], r
    assert r["logit_diff"] < 0.05 * r["logit_scale"], r  # the same model, other kernels (bf16)
    assert math.isfinite(r["loss"]) and r["moved"] > 0 and math.isfinite(r["reward"])


@pytest.mark.gpu
def test_qlora_trains_lora_on_a_4bit_base_and_saves_it_merged_and_dense(tiny_model_dir, tmp_path):
    r = run_worker(["qlora", str(tiny_model_dir), str(tmp_path)])
    assert r["quantized"] > 0 and r["trainable_non_lora"] == [], r
    assert math.isfinite(r["loss"]) and r["moved"] > 0
    assert r["push_metadata_agrees"] and r["push_vs_save"] == 0.0
    saved = run_worker(["reload", str(tmp_path / "saved"), str(tmp_path)])  # a fresh process: no ZeRO state
    assert not saved["quant_config"]
    assert saved["logit_diff"] < 0.05 * saved["logit_scale"], saved  # the dequantized base + adapter, in bf16


@pytest.mark.gpu
def test_deepcompile_compiles_the_engine_and_trains(tiny_model_dir, tmp_path):
    r = run_worker(["deepcompile", str(tiny_model_dir), str(tmp_path)])
    assert r["enabled"] and r["compiled"], r
    assert all(math.isfinite(x) for x in r["losses"]) and r["moved"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs the flash_attn package")
def test_flash_attention_2_is_used_and_trains(tiny_model_dir, tmp_path):
    r = run_worker(["flash", str(tiny_model_dir), str(tmp_path)])
    assert r["attn"] == "flash_attention_2" and math.isfinite(r["loss"]) and r["moved"] > 0


# --------------------------------------------------------------------------- worker side


def _batch(model_dir: str, device):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok, {k: v.to(device) for k, v in tok(["What is 2 + 3? Answer: 5"], return_tensors="pt").items()}


def _step(engine, batch) -> tuple[float, float]:
    """One optimizer step on ``batch`` (a batch of one: accumulation 1); returns the loss and how
    far the trained parameters moved (max abs)."""
    import torch

    from common.weights.source import unwrap

    trained = [(n, p) for n, p in unwrap(engine).named_parameters() if p.requires_grad]
    before = {n: p.detach().float().clone() for n, p in trained}
    loss = engine(**batch, labels=batch["input_ids"]).loss
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        moved = max((p.detach().float() - before[n]).abs().max().item() for n, p in trained)
    return loss.detach().item(), moved


def _engine(model, **kw):
    from learner.runtime import engine as E

    args = dict(zero_stage=2, bf16=True, train_batch_size=1, micro_train_batch_size=1, learning_rate=1e-2)
    engine = E.make_engine(model, **{**args, "num_training_steps": 4, "lr_warmup_ratio": 0.0, **kw})
    engine.train()  # as the trainers do (from_pretrained leaves a model in eval mode)
    return engine


def _said() -> list[str]:
    """The lines ``learner.runtime.gpu_features`` logs from now on."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("rayless.gpu_features").addHandler(Keep())
    return said


def _cpu(model_dir: str) -> dict:
    from learner.runtime import engine as E
    from learner.runtime.flags import DSSection, LoraSection, OptimizerFields, engine_options, model_options
    from learner.runtime.lora import apply_lora
    from learner.runtime.models import load_reward_model

    said = _said()
    E.init_distributed()
    ds = DSSection(**ALL, lora=LoraSection(rank=4))
    batch_kw = dict(train_batch_size=1, micro_train_batch_size=1, num_training_steps=1)
    model = E.load_causal_lm(model_dir, **model_options(ds, gradient_checkpointing=False))
    quant_config = getattr(model.config, "quantization_config", None)
    quantized = sum("4bit" in type(m).__name__ for m in model.modules())
    liger = type(model.model.layers[0].mlp).forward is not model.model.layers[0].mlp.forward.__func__
    policy = E.make_engine(apply_lora(model, ds.lora), **engine_options(ds, OptimizerFields()), **batch_kw)
    rm = load_reward_model(model_dir, **model_options(ds, gradient_checkpointing=False))
    E.make_engine(apply_lora(rm, ds.lora), **engine_options(ds, OptimizerFields()), **batch_kw)  # the critic's
    _, batch = _batch(model_dir, E.device())
    loss, moved = _step(policy, batch)
    return {
        "said": said,
        "quantized": quantized,
        "quant_config": bool(quant_config),
        "liger": liger,
        "compiled": policy.is_compiled,
        "ds_config": sorted(policy.config),
        "loss": loss,
        "moved": moved,
    }


def _liger(model_dir: str) -> dict:
    import torch
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    from learner.runtime import engine as E
    from learner.runtime.models import load_reward_model

    E.init_distributed()
    _, batch = _batch(model_dir, E.device())
    # The plain model first: Liger also swaps transformers' Qwen2 classes for models built later.
    plain = E.load_causal_lm(model_dir, bf16=True).to(E.device())
    with torch.no_grad():
        want = plain(**batch).logits.float()
    del plain
    model = E.load_causal_lm(model_dir, bf16=True, use_liger_kernel=True)
    layer = model.model.layers[0]
    patched = layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward and model.model.norm.forward.__func__ is (
        LigerRMSNorm.forward
    )
    with torch.no_grad():
        got = model.to(E.device())(**batch).logits.float()
    loss, moved = _step(_engine(model), batch)
    rm = load_reward_model(model_dir, bf16=True, use_liger_kernel=True).to(E.device())
    rm_layer = rm.hf_model.model.layers[0]
    with torch.no_grad():
        reward = rm(batch["input_ids"], batch["attention_mask"])
    return {
        "patched": patched,
        "rm_patched": rm_layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward,
        "logit_diff": (got - want).abs().max().item(),
        "logit_scale": want.abs().max().item(),
        "loss": loss,
        "moved": moved,
        "reward": float(reward[0]),
    }


def _qlora(model_dir: str, out: str) -> dict:
    import torch

    from common.weights.source import ModelWeights, unwrap
    from learner.runtime import engine as E
    from learner.runtime.flags import LoraSection
    from learner.runtime.lora import apply_lora, merged_state_dict

    E.init_distributed()
    tok, batch = _batch(model_dir, E.device())
    model = E.load_causal_lm(model_dir, bf16=True, load_in_4bit=True, gradient_checkpointing=True)
    quantized = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    model = apply_lora(model, LoraSection(rank=8), gradient_checkpointing=True)
    engine = _engine(model)
    trainable_non_lora = [n for n, p in unwrap(engine).named_parameters() if p.requires_grad and "lora_" not in n]
    loss, moved = _step(engine, batch)
    with torch.no_grad():
        logits = engine(**batch).logits.float().cpu()
    source = ModelWeights(engine)
    sent = list(source)
    agrees = all(
        m.name == n and tuple(m.shape) == tuple(t.shape) and m.dtype == t.dtype
        for m, (n, t) in zip(source.metadata(), sent, strict=True)
    )
    merged = merged_state_dict(unwrap(engine))
    push_vs_save = max((t.float().cpu() - merged[n].float()).abs().max().item() for n, t in sent)
    E.save_hf(engine, tok, f"{out}/saved")
    torch.save({"logits": logits, "batch": {k: v.cpu() for k, v in batch.items()}}, f"{out}/want.pt")
    return {
        "quantized": quantized,
        "trainable_non_lora": trainable_non_lora,
        "loss": loss,
        "moved": moved,
        "push_metadata_agrees": agrees,
        "push_vs_save": push_vs_save,
    }


def _reload(saved: str, out: str) -> dict:
    """The QLoRA save loaded as a plain model (``from_pretrained``), against the trained model's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    want = torch.load(f"{out}/want.pt")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the worker
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        got = model(**{k: v.to(device) for k, v in want["batch"].items()}).logits.float().cpu()
    return {
        "quant_config": bool(getattr(model.config, "quantization_config", None)),
        "logit_diff": (got - want["logits"]).abs().max().item(),
        "logit_scale": want["logits"].abs().max().item(),
    }


def _deepcompile(model_dir: str) -> dict:
    from learner.runtime import engine as E

    E.init_distributed()
    _, batch = _batch(model_dir, E.device())
    engine = _engine(E.load_causal_lm(model_dir, bf16=True), deepcompile=True)  # one bf16 rank keeps ZeRO-2
    losses, moved = [], 0.0
    for _ in range(2):  # the first compiles; the second runs the compiled graph
        loss, moved = _step(engine, batch)
        losses.append(loss)
    return {
        "enabled": engine.is_deepcompile_enabled(),
        "compiled": engine.is_compiled,
        "losses": losses,
        "moved": moved,
    }


def _flash(model_dir: str) -> dict:
    from learner.runtime import engine as E

    E.init_distributed()
    _, batch = _batch(model_dir, E.device())
    model = E.load_causal_lm(model_dir, bf16=True, flash_attn=True)
    attn = model.config._attn_implementation
    loss, moved = _step(_engine(model), batch)
    return {"attn": attn, "loss": loss, "moved": moved}


def _worker(what: str, model_dir: str, out: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    runs = {
        "cpu": lambda: _cpu(model_dir),
        "liger": lambda: _liger(model_dir),
        "qlora": lambda: _qlora(model_dir, out),
        "reload": lambda: _reload(model_dir, out),
        "deepcompile": lambda: _deepcompile(model_dir),
        "flash": lambda: _flash(model_dir),
    }
    print("RESULT " + json.dumps(runs[what]()), flush=True)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
