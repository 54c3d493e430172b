"""learner.runtime.engine / learner.runtime.deepspeed_config: config arithmetic, LR schedules, and real
DeepSpeed engines on the tiny model on CPU (gloo), each in its own process because a
process group and DeepSpeed's globals live once per process.

The slow tests run this file as a worker script: ``python tests/unit/runtime/test_engine.py WHAT ...``
(plain python = a world of one) or under ``torchrun --standalone --nproc_per_node 2``.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from helpers import procs


def run_worker(args: list[str], *, nproc: int = 1, timeout: float = 300) -> dict:
    return procs.run_worker(__file__, args, nproc=nproc, timeout=timeout)


# --------------------------------------------------------------------------- fast tests


def test_grad_accum_is_derived_and_must_divide():
    from learner.runtime.deepspeed_config import grad_accum_steps, train_ds_config

    assert grad_accum_steps(128, 4, 8) == 4  # 128 = 4 per rank x 8 ranks x 4 micro-steps
    cfg = train_ds_config(
        zero_stage=2, bf16=True, train_batch_size=16, micro_train_batch_size=2, world_size=2, grad_clip=0.5
    )
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_batch_size"] == 16
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 0.5
    with pytest.raises(ValueError, match="not a multiple"):
        grad_accum_steps(10, 4, 1)
    with pytest.raises(ValueError, match="adam_offload needs"):
        train_ds_config(
            zero_stage=0, bf16=False, train_batch_size=4, micro_train_batch_size=4, world_size=1, adam_offload=True
        )
    off = train_ds_config(
        zero_stage=3, bf16=False, train_batch_size=4, micro_train_batch_size=4, world_size=1, adam_offload=True
    )
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_one_fp32_rank_runs_zero_1_and_2_as_stage_0():
    from learner.runtime.deepspeed_config import effective_zero_stage, train_ds_config

    kw = dict(bf16=False, train_batch_size=4, micro_train_batch_size=2)
    for stage in (1, 2):
        assert train_ds_config(zero_stage=stage, world_size=1, **kw)["zero_optimization"]["stage"] == 0
        assert train_ds_config(zero_stage=stage, world_size=2, **kw)["zero_optimization"]["stage"] == stage
        # bf16 (no stage-0 path with fp32 accumulation) and offload (needs ZeRO) keep the stage
        assert effective_zero_stage(stage, world_size=1, bf16=True, adam_offload=False) == stage
        assert effective_zero_stage(stage, world_size=1, bf16=False, adam_offload=True) == stage
    assert effective_zero_stage(3, world_size=1, bf16=False, adam_offload=False) == 3
    z = train_ds_config(zero_stage=2, world_size=2, contiguous_gradients=False, **kw)["zero_optimization"]
    assert z["contiguous_gradients"] is False  # CPUs (make_engine); GPUs keep DeepSpeed's True


def test_frozen_config_only_keeps_stage3_and_offload_forces_it():
    from learner.runtime.deepspeed_config import frozen_ds_config, load_ds_config

    assert frozen_ds_config(zero_stage=2, bf16=False)["zero_optimization"]["stage"] == 0
    assert frozen_ds_config(zero_stage=3, bf16=False)["zero_optimization"]["stage"] == 3
    off = frozen_ds_config(zero_stage=1, bf16=True, offload=True)["zero_optimization"]
    assert off["stage"] == 3 and off["offload_param"]["device"] == "cpu"
    assert load_ds_config(zero_stage=2, bf16=False) is None
    assert load_ds_config(zero_stage=3, bf16=True)["zero_optimization"]["stage"] == 3


def test_lr_schedules_warm_up_then_decay_to_min():
    import torch

    from learner.runtime.engine import make_lr_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_lr_scheduler(opt, name="cosine_with_min_lr", num_training_steps=20, warmup_ratio=0.1, min_lr_ratio=0.1)
    lrs = []
    for _ in range(21):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warmup = ceil(0.1 * 20) = 2 steps: 1/2, 2/2; then cosine from 1.0 down to 0.1 at step 20.
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(1.0) and lrs[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))
    with pytest.raises(ValueError, match="unknown --lr_scheduler"):
        make_lr_scheduler(opt, name="nope", num_training_steps=3)


# --------------------------------------------------------------------------- real engines


@pytest.mark.slow
def test_zero2_engine_steps_and_resumes_from_checkpoint(tiny_model_dir, tmp_path):
    """A world of one (plain python): loss falls, a checkpoint restores weights and step."""
    r = run_worker(["zero2", str(tiny_model_dir), str(tmp_path)])
    assert r["losses"][-1] < r["losses"][0] - 0.5, r
    assert r["world_size"] == 1 and r["optimizer_steps"] == 3
    assert r["client_step"] == 3 and r["resumed_equal"] and r["moved"] > 0
    assert r["resumed_global_steps"] == 3


@pytest.mark.slow
def test_zero3_two_ranks_partition_train_and_save_hf(tiny_model_dir, tmp_path):
    """Two ranks under torchrun: ZeRO-3 loads partitioned, trains, gathers and saves HF
    weights that plain transformers loads equal to the engine's gathered parameters."""
    r = run_worker(["zero3", str(tiny_model_dir), str(tmp_path)], nproc=2)
    assert r["world_size"] == 2 and r["partitioned"] and r["moved"] > 0
    assert r["reduced_mean"] == 0.5  # mean of ranks 0 and 1

    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    gathered = torch.load(tmp_path / "gathered.pt")
    state = saved.state_dict()
    assert set(gathered) <= set(state)
    for name, tensor in gathered.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(saved.lm_head.weight, saved.model.embed_tokens.weight)  # still tied


@pytest.mark.slow
def test_one_rank_engine_updates_as_plain_torch_without_the_lone_allreduce(tiny_model_dir, tmp_path):
    """One fp32 rank: DeepSpeed's gradient all-reduce with itself is switched off
    (``skip_lone_allreduce``) and the optimizer is torch's fused AdamW, yet two accumulated
    micro-batches, clipping and one step move every parameter as plain torch does (unfused
    AdamW, ``clip_grad_norm_``), to float rounding."""
    r = run_worker(["lone", str(tiny_model_dir), str(tmp_path)])
    assert r["world_size"] == 1 and r["skipped"] and not r["allreduce_on"]
    assert r["fused"] and r["optimizer_steps"] == 1
    assert r["moved"] > 1e-4  # the step did something
    assert r["max_diff"] < 1e-6, r


# --------------------------------------------------------------------------- worker side


def _lone(model_dir: str) -> dict:
    """``test_one_rank_engine_updates_as_plain_torch_without_the_lone_allreduce``'s worker."""
    import torch
    from transformers import AutoTokenizer

    from common.weights.source import unwrap
    from learner.runtime import engine as E

    info = E.init_distributed()
    eng = E.make_engine(
        E.load_causal_lm(model_dir, zero_stage=2, bf16=False),  # one fp32 rank: stage 0
        zero_stage=2,
        bf16=False,
        train_batch_size=2,
        micro_train_batch_size=1,
        learning_rate=1e-2,
        num_training_steps=10,
        grad_clip=1.0,
        lr_scheduler="constant_with_warmup",
        lr_warmup_ratio=0.0,
    )
    plain = E.load_causal_lm(model_dir, zero_stage=0, bf16=False)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["What is 2 + 3? Answer: 5", "Reverse 123: 321"]
    before = {n: t.detach().clone() for n, t in plain.named_parameters()}
    for text in texts:  # accumulation 2: one optimizer step
        batch = tok([text], return_tensors="pt")
        eng.backward(eng(**batch, labels=batch["input_ids"]).loss)
        eng.step()
        (plain(**batch, labels=batch["input_ids"]).loss / len(texts)).backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    opt.step()
    ours = dict(unwrap(eng).named_parameters())
    return {
        "world_size": info.world_size,
        "skipped": not eng.enable_backward_allreduce,
        "allreduce_on": eng.enable_backward_allreduce,
        "fused": all(g.get("fused") for g in eng.optimizer.param_groups),
        "optimizer_steps": eng.global_steps,
        "moved": max((p - before[n]).abs().max().item() for n, p in plain.named_parameters()),
        "max_diff": max((ours[n] - p).abs().max().item() for n, p in plain.named_parameters()),
    }


def _worker(what: str, model_dir: str, out: str) -> None:
    import torch
    from transformers import AutoTokenizer

    from helpers.params import full_named_parameters
    from learner.runtime import engine as E

    torch.manual_seed(0)
    if what == "lone":
        print("RESULT " + json.dumps(_lone(model_dir)), flush=True)
        return
    info = E.init_distributed()
    stage = 2 if what == "zero2" else 3
    model = E.load_causal_lm(model_dir, zero_stage=stage, bf16=False)
    result = {"world_size": info.world_size}
    embed = model.model.embed_tokens.weight
    result["partitioned"] = hasattr(embed, "ds_id") and embed.numel() == 0
    eng = E.make_engine(
        model,
        zero_stage=stage,
        bf16=False,
        train_batch_size=2 * info.world_size,
        micro_train_batch_size=1,
        learning_rate=1e-2,
        num_training_steps=10,
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = tok(["What is 2 + 3? Answer: 5"], return_tensors="pt").to(E.device())
    before = {n: t.clone() for n, t in full_named_parameters(eng)}
    losses = []
    for _ in range(6):  # 6 micro-steps, accumulation 2: three optimizer steps
        loss = eng(**batch, labels=batch["input_ids"]).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    after = {n: t.clone() for n, t in full_named_parameters(eng)}
    result.update(
        losses=losses,
        optimizer_steps=eng.global_steps,
        moved=max((after[n] - before[n]).abs().max().item() for n in after),
    )
    result["reduced_mean"] = E.all_reduce_mean(float(info.rank))

    if what == "zero2":
        E.save_checkpoint(eng, Path(out) / "ckpt", tag="global_step3", client_state={"step": 3})
        for _ in range(2):  # move on, then come back
            eng.backward(eng(**batch, labels=batch["input_ids"]).loss)
            eng.step()
        state = E.load_checkpoint(eng, Path(out) / "ckpt")
        resumed = {n: t.clone() for n, t in full_named_parameters(eng)}
        result.update(
            client_step=state["step"],
            resumed_global_steps=eng.global_steps,
            resumed_equal=all(torch.equal(resumed[n], after[n]) for n in after),
        )
        assert E.load_checkpoint(eng, Path(out) / "nothing-here") is None
    else:
        E.save_hf(eng, tok, Path(out) / "hf")
        if E.is_rank0():
            torch.save(after, Path(out) / "gathered.pt")
    E.barrier()
    if E.is_rank0():
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
