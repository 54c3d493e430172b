"""``--optim muon`` (learner.runtime.muon): which parameters Muon trains, the flags, and one real
DeepSpeed step per ZeRO stage on the tiny model on CPU that moves the 2-D hidden weights as Muon
does and the rest as AdamW; then train_sft learning with it and resuming exactly.

The slow tests run this file as a worker script (``python tests/unit/runtime/test_muon.py step
MODEL_DIR STAGE:DTYPE ...``, or under torchrun for two ranks).
"""

from __future__ import annotations

import json
import sys

import pytest

from helpers import procs

MUON_LR, ADAM_LR, MOMENTUM = 0.02, 1e-3, 0.9

# The tiny Qwen2 (common/tiny.py): two layers, hidden 128, tied embeddings. Worked out by hand from
# its architecture: every projection is a hidden 2-D matrix; the (tied) embedding, the q/k/v
# biases and the RMSNorm weights are AdamW's.
TINY_MUON = [
    f"model.layers.{i}.{m}.weight"
    for i in (0, 1)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]
TINY_ADAM = [
    "model.embed_tokens.weight",
    *(f"model.layers.{i}.self_attn.{x}_proj.bias" for i in (0, 1) for x in "qkv"),
    *(f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")),
    "model.norm.weight",
]


# --------------------------------------------------------------------------- fast tests


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from learner.runtime.muon import muon_split

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    muon, adam = muon_split(model)
    assert sorted(muon) == sorted(TINY_MUON)
    assert sorted(adam) == sorted(TINY_ADAM)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)  # frozen: neither optimizer's
    muon, adam = muon_split(model)
    assert "model.layers.0.mlp.up_proj.weight" not in muon + adam and len(muon) == 13


def test_output_heads_and_scalar_heads_go_to_adamw(tiny_model_dir):
    """An untied LM head (named ``lm_head``, or anything its model's ``get_output_embeddings``
    returns) and a reward model's ``1 x hidden`` score head are AdamW's; DeepSpeed's own rule
    would give the score head to Muon."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from learner.runtime.muon import muon_split, uses_muon

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = False
    lm = AutoModelForCausalLM.from_config(config)
    muon, adam = muon_split(lm)
    assert "lm_head.weight" in adam and sorted(muon) == sorted(TINY_MUON)

    class Renamed(torch.nn.Module):  # an output head under another name, found as the model's head
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 16, bias=False)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.out

    assert muon_split(Renamed()) == (["body.weight"], ["body.bias", "out.weight"])

    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    rm = AutoModelForSequenceClassification.from_config(config)
    assert tuple(rm.score.weight.shape) == (1, 128)
    muon, adam = muon_split(rm)
    assert "score.weight" in adam and len(muon) == 14

    # A ZeRO-3 partition is flat (even empty); its layer shape decides.
    shard = torch.nn.Parameter(torch.empty(0))
    shard.ds_shape = torch.Size([128, 128])
    assert uses_muon("model.layers.0.mlp.up_proj.weight", shard)
    shard.ds_shape = torch.Size([128])
    assert not uses_muon("model.layers.0.input_layernorm.weight", shard)


def test_the_flags_reach_the_engine_and_the_fixed_ones_are_said():
    from common.config import build, parse
    from learner.runtime.flags import OptimizerFields
    from learner.train_sft import SFTConfig

    argv = ["--pretrain", "m", "--dataset", "d", "--optim", "muon", "--muon.lr", "0.01", "--muon.momentum", "0.9"]
    cfg = parse(SFTConfig, [*argv, "--muon.ns_steps", "7", "--muon.no_nesterov", "--adam.lr", "3e-4"])
    opts = cfg.optimizer_options()
    assert (opts["optim"], opts["muon_lr"], opts["muon_momentum"], opts["learning_rate"]) == ("muon", 0.01, 0.9, 3e-4)
    said = "\n".join(cfg.notices)
    assert "--muon.ns_steps 7: accepted, but DeepSpeed's Muon always runs 5 Newton-Schulz steps" in said
    assert "--muon.no_nesterov True: accepted, but" in said
    assert parse(SFTConfig, argv).notices == []  # lr and momentum act
    with pytest.raises(ValueError, match=r"--muon.momentum must be in \[0, 1\), got 1.0"):
        build(SFTConfig, pretrain="m", dataset="d", optim="muon", **{"muon.momentum": 1.0})
    with pytest.raises(ValueError, match=r"--actor.muon.lr must be >= 0"):
        build(OptimizerFields, **{"muon.lr": -1.0}).check_optimizer("actor.")


def test_train_ppo_takes_muon_per_model():
    """OpenRLHF 0.10's layout: the actor on Muon, the critic (its value head is a vector) on AdamW."""
    from common.config import parse
    from learner.rl.config import PPOConfig
    from learner.runtime.flags import engine_options

    argv = ["--pretrain", "m", "--prompt_data", "p", "--actor.optim", "muon", "--actor.muon.lr", "0.01"]
    cfg = parse(PPOConfig, [*argv, "--critic.optim", "adam", "--actor.muon.ns_steps", "5"])
    actor, critic = engine_options(cfg.ds, cfg.actor), engine_options(cfg.ds, cfg.critic)
    assert (actor["optim"], actor["muon_lr"], critic["optim"]) == ("muon", 0.01, "adam")
    assert any(n.startswith("--actor.muon.ns_steps 5: accepted, but DeepSpeed's Muon") for n in cfg.notices)


def test_zero3_turns_reduce_scatter_off_for_muon():
    from learner.runtime.deepspeed_config import train_ds_config

    kw = dict(bf16=False, train_batch_size=4, micro_train_batch_size=1, world_size=2)
    assert train_ds_config(zero_stage=3, muon=True, **kw)["zero_optimization"]["reduce_scatter"] is False
    assert "reduce_scatter" not in train_ds_config(zero_stage=3, **kw)["zero_optimization"]
    assert "reduce_scatter" not in train_ds_config(zero_stage=2, muon=True, **kw)["zero_optimization"]


# --------------------------------------------------------------------------- real engines


def _check_step(r: dict, stage: int, wrapper: str) -> None:
    assert r["wrapper"] == wrapper, r
    assert r["muon_names"] == sorted(TINY_MUON), r
    assert r["groups"] == [[True, MUON_LR], [False, ADAM_LR], [False, ADAM_LR]], r  # Muon's first, then decay/no
    assert r["muon_rel_err"] < 1e-3, r
    assert r["polar_cos"] > 0.8, r  # along the gradient's polar factor, to Newton-Schulz's accuracy
    assert 0.6 < r["step_sv_min"] and r["step_sv_max"] < 1.4, r  # near equal, in units of muon_lr
    assert r["grad_sv_spread"] > 10, r  # ... where the gradient's own singular values differ widely
    # In units of adam_lr; elements whose gradient is near eps are sensitive to the order of sums.
    assert r["adam_err"] < 0.05, r
    if stage >= 2:  # a clip meant for gradients would shrink every Muon step: said at start-up
        assert "DeepSpeed takes the clipping norm over Muon's orthogonalised update" in r["clip_notice"], r
    else:
        assert r["clip_notice"] == "", r


@pytest.mark.slow
def test_one_step_moves_matrices_as_muon_and_the_rest_as_adamw(tiny_model_dir):
    """From the same weights and batch as a plain torch twin, one optimizer step moves each Muon
    matrix by ``-muon_lr x muon_update(G)`` (DeepSpeed's own Newton-Schulz on the twin's gradient G)
    and, checked apart from DeepSpeed, along G's orthogonal polar factor U V^T (from G's SVD): on
    G's significant directions the step's singular values are all about ``muon_lr`` where G's
    span a factor of 20. Every other parameter moves by AdamW's first step,
    ``-adam_lr g / (|g| + eps)``. One process, one rank, three engines: each of DeepSpeed's paths
    that runs Muon without sharding."""
    cases = {
        "0:fp32": "MuonWithAuxAdam",  # no ZeRO: Muon orthogonalises in its own step
        "1:bf16": "BF16_Optimizer",  # DeepSpeed's bf16 optimizer (ZeRO-0/1 in bf16)
        "2:bf16": "DeepSpeedZeroOptimizer",  # ZeRO-1/2: in the flat gradient partitions
    }
    results = procs.run_worker(__file__, ["step", str(tiny_model_dir), *cases], timeout=400)
    for case, wrapper in cases.items():
        _check_step(results[case], int(case[0]), wrapper)


@pytest.mark.slow
def test_a_zero3_step_on_two_ranks_moves_sharded_matrices_as_muon(tiny_model_dir):
    """The same at ZeRO-3 on two ranks, each matrix sharded between them (every rank steps on the
    same batch, so the averaged gradient is the twin's)."""
    r = procs.run_worker(__file__, ["step", str(tiny_model_dir), "3:fp32"], nproc=2, timeout=400)
    assert r["3:fp32"]["world_size"] == 2
    _check_step(r["3:fp32"], 3, "DeepSpeedZeroOptimizer_Stage3")


@pytest.mark.slow
def test_sft_learns_with_muon_and_resumes_to_the_same_losses(tiny_model_dir, tmp_path):
    """train_sft --optim muon (ZeRO-2 asked, one rank: stage 0): the held-out loss falls, and the run
    resumed from its step-2 checkpoint (Muon's momentum and AdamW's moments inside) logs the
    uninterrupted run's losses."""
    from learner.supervised.synthetic_data import write_all

    data = tmp_path / "data"
    write_all(data, n_train=32, n_eval=16)

    def args(save, *extra):
        return [
            *("--pretrain", str(tiny_model_dir), "--dataset", str(data / "sft_train.jsonl")),
            *("--eval_dataset", str(data / "sft_eval.jsonl"), "--input_key", "input", "--output_key", "output"),
            *("--apply_chat_template", "--packing_samples", "--train_batch_size", "8"),
            *("--micro_train_batch_size", "8", "--max_epochs", "1", "--max_len", "64", "--zero_stage", "2"),
            *("--optim", "muon", "--muon.lr", "0.02", "--adam.lr", "3e-3", "--max_norm", "0"),
            *("--save_path", str(save), "--logging_steps", "1", "--save_steps", "2", "--eval_at_start"),
            *extra,
        ]

    full = tmp_path / "full"
    out = procs.run_module("learner.train_sft", args(full))
    assert "Muon trains 14 weight matrices, AdamW the other 12 trainable tensors" in out
    log = procs.read_log(full)
    evals = [r["eval/loss"] for r in log if "eval/loss" in r]
    assert evals[-1] < 0.45 * evals[0], evals  # measured: 7.01 -> 2.10 (AdamW at 3e-3: 1.43)
    losses = {r["step"]: r["train/loss"] for r in log if "train/loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]

    again = tmp_path / "again"
    step2 = full / "checkpoints" / "step_00000002"
    out = procs.run_module("learner.train_sft", args(again, "--load_checkpoint", "--ckpt_path", str(step2)))
    assert f"resumed from {step2}: step 2" in out
    resumed = {r["step"]: r["train/loss"] for r in procs.read_log(again) if "train/loss" in r}
    assert sorted(resumed) == [3, 4]
    for step, loss in resumed.items():
        assert loss == pytest.approx(losses[step], rel=1e-4, abs=1e-5), step


# --------------------------------------------------------------------------- worker side


def _master_weights(eng):
    """(name, fp32 weight) of every parameter: the optimizer's fp32 master copy under ZeRO and
    bf16 (a bf16 weight would round a 1e-3 step of a norm weight to 0 or 2^-7), else the parameter.
    A collective under ZeRO-3: every rank in the same order."""
    from deepspeed.utils import safe_get_full_fp32_param

    for name, p in eng.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        yield name, (p if master is None else master).detach().float().cpu().clone()


def _step(model_dir: str, stage: int, dtype: str) -> dict:
    """The step tests' worker: one engine of ``stage`` in ``dtype``, one optimizer step, measured."""
    import torch
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    from transformers import AutoTokenizer

    from learner.runtime import engine as E
    from learner.runtime import muon

    torch.manual_seed(0)
    info = E.init_distributed()
    bf16 = dtype == "bf16"
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["What is 2 + 3? Answer: 5", "Reverse the string: abc. Answer: cba", "What is 7 + 8? Answer: 15"]
    batch = tok(texts, return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)

    # The twin first: a ZeRO-3 load leaves transformers building every later model partitioned.
    twin = E.load_causal_lm(model_dir, zero_stage=0, bf16=bf16)  # the engine's dtype: the same gradient
    twin(**batch, labels=labels).loss.backward()
    grads = {n: p.grad.detach().float() for n, p in twin.named_parameters()}

    model = E.load_causal_lm(model_dir, zero_stage=stage, bf16=bf16)
    eng = E.make_engine(
        model,
        zero_stage=stage,
        bf16=bf16,
        train_batch_size=len(texts) * info.world_size,  # every rank the same batch: the mean is its gradient
        micro_train_batch_size=len(texts),
        learning_rate=ADAM_LR,
        num_training_steps=10,
        grad_clip=0.0,
        lr_scheduler="constant",
        lr_warmup_ratio=0.0,
        optim="muon",
        muon_lr=MUON_LR,
        muon_momentum=MOMENTUM,
    )
    before = dict(_master_weights(eng))
    eng.backward(eng(**{k: v.to(E.device()) for k, v in batch.items()}, labels=labels.to(E.device())).loss)
    eng.step()
    after = dict(_master_weights(eng))

    muon_names, _ = muon.muon_split(eng.module)
    wrapper = type(eng.optimizer).__name__
    rel_err, cos, sv_min, sv_max, spread, adam_err = 0.0, 1.0, 1e9, 0.0, 1e9, 0.0
    for name, g in grads.items():
        step = after[name] - before[name]
        if name in muon_names:
            # ZeRO-1/2 under bf16 runs Muon on the bf16 gradient, with a bf16 momentum (DeepSpeed's
            # _muon_momentum_buffer); its other paths in fp32.
            g_muon = g.to(torch.bfloat16) if bf16 and wrapper == "DeepSpeedZeroOptimizer" else g
            expected = -MUON_LR * muon_update(g_muon.clone(), torch.zeros_like(g_muon), beta=MOMENTUM).float()
            rel_err = max(rel_err, ((step - expected).norm() / expected.norm()).item())
            # Apart from DeepSpeed: G = U S V^T; on the directions where G is not negligible the
            # step should be -lr U V^T, every singular value lr.
            u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
            k = int((s > 1e-2 * s[0]).sum())
            polar = -(u[:, :k] @ vh[:k]).float()
            cos = min(cos, (torch.sum(step * polar) / (step.norm() * polar.norm())).item())
            on_span = u[:, :k].T.float() @ step @ vh[:k].T.float()  # the step within G's top-k span
            sv = torch.linalg.svdvals(on_span) / MUON_LR
            scale = max(1.0, g.shape[0] / g.shape[1]) ** 0.5  # Muon's aspect-ratio scale
            sv_min, sv_max = min(sv_min, (sv.min() / scale).item()), max(sv_max, (sv.max() / scale).item())
            spread = min(spread, (s[0] / s[k - 1]).item())
        else:
            expected = -ADAM_LR * g / (g.abs() + 1e-8)  # AdamW's first step, bias-corrected
            adam_err = max(adam_err, ((step - expected).abs().max() / ADAM_LR).item())
    groups = [[bool(g["use_muon"]), g["lr"]] for g in eng.basic_optimizer.param_groups]
    return {
        "world_size": info.world_size,
        "wrapper": wrapper,
        "muon_names": sorted(muon_names),
        "groups": groups,
        "muon_rel_err": rel_err,
        "polar_cos": cos,
        "step_sv_min": sv_min,
        "step_sv_max": sv_max,
        "grad_sv_spread": spread,
        "adam_err": adam_err,
        "clip_notice": muon.clip_notice(eng, 1.0),
    }


if __name__ == "__main__":
    # step MODEL_DIR STAGE:DTYPE ...: one engine after another in this process.
    what, model_dir, *cases = sys.argv[1:]
    assert what == "step", what
    results = {}
    for case in cases:
        stage, dtype = case.split(":")
        results[case] = _step(model_dir, int(stage), dtype)
    from learner.runtime import engine as E

    E.barrier()
    if E.is_rank0():
        print("RESULT " + json.dumps(results), flush=True)


def test_muon_flags_without_optim_muon_are_said_to_do_nothing():
    from common.config import parse
    from learner.rl.config import PPOConfig
    from learner.train_sft import SFTConfig

    cfg = parse(SFTConfig, ["--pretrain", "m", "--dataset", "d", "--muon.lr", "0.01", "--muon.momentum", "0.9"])
    assert "--muon.lr, --muon.momentum: no effect without --optim muon (the optimizer is AdamW)" in cfg.notices
    argv = ["--pretrain", "m", "--prompt_data", "p", "--actor.optim", "muon", "--actor.muon.lr", "0.01"]
    said = parse(PPOConfig, [*argv, "--critic.muon.lr", "0.01"]).notices
    assert "--critic.muon.lr: no effect without --critic.optim muon (the optimizer is AdamW)" in said
    assert not any(n.startswith("--actor.muon.lr") for n in said)
