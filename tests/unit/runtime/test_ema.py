"""learner.runtime.ema: the moving average of a model's trained parameters.

Fast tests on plain modules (one rank): three updates against the formula worked by hand, only
the trained parameters averaged (LoRA: the adapter), the average put into the model for a save
and the trained values given back bit-exactly, the HF files it writes (full model and LoRA), its
checkpoint shards round-tripped bit-exactly and refused when they do not fit.

The slow test runs the real thing on 2 gloo ranks (this file as a torchrun worker): DeepSpeed
ZeRO-3 (each rank averages its own partitions; some parameters persistent, some not) and ZeRO-2
(each rank a slice of the whole parameters), three optimizer steps, against an average of the
gathered parameters computed beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers.procs import run_worker
from learner.runtime.ema import EMA


class Tiny(torch.nn.Module):
    """A trained parameter ``w`` and a frozen one, as a LoRA model has a frozen base."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        self.frozen = torch.nn.Parameter(torch.tensor([7.0]), requires_grad=False)


def test_three_updates_equal_the_formula_worked_by_hand():
    """ema_0 = w_0; ema_k = beta ema_{k-1} + (1 - beta) w_k with beta = 3/4 (every number below is
    a binary fraction, so the float results are exact):
        w_0 = ( 1, -2)                                             ema_0 = ( 1,        -2)
        w_1 = ( 2,  0): 3/4 ( 1,      -2)     + 1/4 ( 2, 0)      = ema_1 = ( 1.25,     -1.5)
        w_2 = ( 0,  4): 3/4 ( 1.25,   -1.5)   + 1/4 ( 0, 4)      = ema_2 = ( 0.9375,   -0.125)
        w_3 = (-1,  1): 3/4 ( 0.9375, -0.125) + 1/4 (-1, 1)      = ema_3 = ( 0.453125,  0.15625)
    """
    m = Tiny()
    ema = EMA(m, beta=0.75)
    assert set(ema.shards) == {"w"}  # the frozen parameter has no average of its own
    expected = [(1.25, -1.5), (0.9375, -0.125), (0.453125, 0.15625)]
    for w, want in zip([(2.0, 0.0), (0.0, 4.0), (-1.0, 1.0)], expected, strict=True):
        with torch.no_grad():
            m.w.copy_(torch.tensor(w))
        ema.update()
        assert torch.equal(ema.shards["w"], torch.tensor(want)), (w, ema.shards["w"])
    assert ema.updates == 3
    assert ema.shards["w"].dtype == torch.float32 and ema.nbytes() == 8


def test_openrlhfs_default_beta_in_closed_form():
    """With beta = 0.992: ema_3 = beta^3 w_0 + (1 - beta) (beta^2 w_1 + beta w_2 + w_3)."""
    m, b = Tiny(), 0.992
    ema = EMA(m, beta=b)
    ws = [torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0]), torch.tensor([-1.0, 1.0])]
    for w in ws:
        with torch.no_grad():
            m.w.copy_(w)
        ema.update()
    w0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    want = b**3 * w0 + (1 - b) * (b**2 * ws[0].double() + b * ws[1].double() + ws[2].double())
    torch.testing.assert_close(ema.shards["w"].double(), want, rtol=1e-6, atol=0)


def test_beta_outside_the_open_interval_is_refused():
    for beta in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="beta must be in"):
            EMA(Tiny(), beta=beta)


def test_the_average_is_applied_for_a_save_and_the_trained_values_come_back_bit_exactly():
    m = Tiny()
    ema = EMA(m, beta=0.5)
    trained = torch.tensor([0.1, 1 / 3])  # not binary fractions: a lossy round trip would show
    with torch.no_grad():
        m.w.copy_(trained)
    ema.update()  # (1 + 0.1) / 2, (-2 + 1/3) / 2
    with ema.applied():
        assert torch.equal(m.w.detach(), ema.shards["w"])
        assert torch.equal(m.frozen.detach(), torch.tensor([7.0]))
    assert torch.equal(m.w.detach(), trained)
    with pytest.raises(RuntimeError, match="inside"), ema.applied():
        raise RuntimeError("a save failed inside")
    assert torch.equal(m.w.detach(), trained)  # given back after a failure too


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _perturb(model: torch.nn.Module, scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


def test_save_hf_writes_the_average_as_the_model_and_leaves_the_trained_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema = EMA(model, beta=0.75)
    _perturb(model, 0.1)
    ema.update()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema.save_hf(model, None, tmp_path / "ema")
    saved = _load(tmp_path / "ema" / "model.safetensors")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name  # the live model is the trained one again
        want = (0.75 * start[name] + 0.25 * trained[name]) if name in ema.shards else start[name]
        torch.testing.assert_close(saved[name], want, rtol=1e-6, atol=1e-7)
        assert not torch.equal(saved[name], trained[name]), name


def test_with_lora_only_the_adapter_is_averaged_and_the_merge_uses_the_average(tiny_model_dir, tmp_path):
    from helpers.lora_models import lora_model
    from learner.runtime.lora import ADAPTER_DIR

    model = lora_model(tiny_model_dir)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)  # the adapter trains (lora_model leaves it in eval mode)
    ema = EMA(model, beta=0.5)
    assert ema.shards and all("lora_" in n for n in ema.shards)
    start = {n: t.clone() for n, t in ema.shards.items()}
    _perturb(model, 0.05)
    ema.update()
    ema.save_hf(model, None, tmp_path / "ema")
    adapter = _load(tmp_path / "ema" / ADAPTER_DIR / "adapter_model.safetensors")
    lora_b = sorted(n for n in ema.shards if ".lora_B." in n)[0]
    saved_b = next(t for k, t in adapter.items() if lora_b.replace(".default", "").endswith(k.split("base_model.")[-1]))
    assert torch.equal(saved_b.reshape(-1), ema.shards[lora_b]), lora_b
    for n, t in ema.shards.items():  # halfway between where it started and the trained adapter
        live = dict(model.named_parameters())[n].detach().reshape(-1)
        torch.testing.assert_close(t, (start[n] + live) / 2, rtol=0, atol=1e-7)
    # the merged weight of an adapted layer is W + s B A with the averaged B and A
    merged = _load(tmp_path / "ema" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj"
    layer = dict(model.named_modules())["base_model.model." + q]
    a = ema.shards[f"base_model.model.{q}.lora_A.default.weight"].view(layer.lora_A["default"].weight.shape)
    b = ema.shards[f"base_model.model.{q}.lora_B.default.weight"].view(layer.lora_B["default"].weight.shape)
    want = layer.base_layer.weight.detach() + layer.scaling["default"] * (b @ a)
    torch.testing.assert_close(merged[q + ".weight"], want, rtol=1e-5, atol=1e-6)


def test_checkpoint_shards_round_trip_bit_exactly_and_other_shapes_are_refused(tmp_path):
    m = Tiny()
    ema = EMA(m, beta=0.75)
    with torch.no_grad():
        m.w.copy_(torch.tensor([0.1, 1 / 3]))
    ema.update()
    ema.save_checkpoint(str(tmp_path), "ds", {})
    assert (tmp_path / "ds" / "rank_0.pt").is_file()

    fresh_model = Tiny()
    fresh = EMA(fresh_model, beta=0.75)
    assert fresh.load_checkpoint(str(tmp_path), "ds") == (str(tmp_path), {})
    assert torch.equal(fresh.shards["w"], ema.shards["w"]) and fresh.updates == 1
    for e, model in ((ema, m), (fresh, fresh_model)):  # both continue alike
        with torch.no_grad():
            model.w.copy_(torch.tensor([0.7, -0.3]))
        e.update()
    assert torch.equal(fresh.shards["w"], ema.shards["w"])

    class Wider(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3))

    with pytest.raises(ValueError, match=r"w: a shard of \(2,\), here \(3,\)"):
        EMA(Wider(), beta=0.75).load_checkpoint(str(tmp_path), "ds")
    with pytest.raises(ValueError, match="saved without --train.enable_ema"):
        EMA(Tiny(), beta=0.75).load_checkpoint(str(tmp_path / "elsewhere"), "ds")


# --------------------------------------------------------------------------- real engines


@pytest.mark.slow
def test_zero3_partitions_and_zero2_slices_on_two_ranks_average_what_was_trained(tiny_model_dir, tmp_path):
    r = run_worker(__file__, [str(tiny_model_dir), str(tmp_path)], nproc=2, timeout=600)
    for stage in ("3", "2"):
        s = r[stage]
        assert s["moved"] > 1e-4, s  # the steps trained something
        assert s["updates"] == 3, s
        # the rank's shards against the average of the gathered parameters computed beside them
        # (the same fp32 operations, summed in chunks of another alignment: rounding only)
        assert s["shard_diff"] <= 1e-6, s
        assert s["saved_diff"] <= 1e-6, s  # the HF model written is that average
        assert s["trained_restored"], s  # and the live model is the trained one again, bit for bit
        assert s["loss_after_save_equal"], s  # it computes as before the save (ZeRO-3: gathered anew)
        assert s["checkpoint_bit_exact"], s
        # each rank holds about half: 4 bytes x trained parameters / 2, plus ZeRO-3's padding
        assert s["bytes_total"] == pytest.approx(4 * s["trained_numel"], rel=0.01), s
        assert max(s["bytes_per_rank"]) <= 0.51 * 4 * s["trained_numel"], s
    assert r["3"]["persistent"] and r["3"]["partitioned"], r["3"]  # both kinds of ZeRO-3 parameter met


def _stage(model_dir: str, stage: int, tmp: Path) -> dict:
    import torch.distributed as dist

    from helpers.params import full_named_parameters
    from learner.runtime import engine as E
    from learner.runtime.deepspeed_config import train_ds_config

    beta = 0.75
    zero = train_ds_config(
        zero_stage=stage,
        bf16=False,
        train_batch_size=4,
        micro_train_batch_size=2,
        world_size=2,
        contiguous_gradients=False,
    )["zero_optimization"]
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 1000  # the norms stay whole on each rank, the matrices do not
    torch.manual_seed(0)
    engine = E.make_engine(
        E.load_causal_lm(model_dir, zero_stage=stage),
        zero_stage=stage,
        bf16=False,
        train_batch_size=4,
        micro_train_batch_size=2,
        learning_rate=1e-2,
        num_training_steps=10,
        lr_scheduler="constant_with_warmup",
        lr_warmup_ratio=0.0,
        ds_extra={"zero_optimization": zero},
    )
    out: dict = {}
    if stage == 3:
        params = [p for _, p in engine.module.named_parameters()]
        out["persistent"] = any(getattr(p, "ds_persist", False) for p in params)
        out["partitioned"] = any(not getattr(p, "ds_persist", False) for p in params)

    def full() -> dict[str, torch.Tensor]:
        return {n: t.float().clone() for n, t in full_named_parameters(engine)}

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = ["12+34=46", "reverse 4721 1274"] if dist.get_rank() == 0 else ["5+5=10", "reverse 1234 4321"]
    batch = tok(text, return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)

    def forward_loss() -> float:
        with torch.no_grad():
            return float(engine(**batch, labels=labels).loss)

    def train_step() -> float:
        loss = engine(**batch, labels=labels).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    ema = EMA(engine, beta)
    ref = full()  # the average of the whole parameters, kept beside on every rank
    start = {n: t.clone() for n, t in ref.items()}
    for _ in range(3):
        train_step()
        for n, t in full().items():
            ref[n].mul_(beta).add_(t, alpha=1 - beta)
        ema.update()
    now = full()
    out["updates"] = ema.updates
    out["moved"] = max(float((now[n] - start[n]).abs().max()) for n in now)
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = 0.0
    for name, shard in ema.shards.items():
        s = shard.numel()
        want = ref[name].reshape(-1)[rank * s : (rank + 1) * s]
        worst = max(worst, float((shard[: want.numel()] - want).abs().max()) if want.numel() else 0.0)
    out["shard_diff"] = worst

    loss_before = forward_loss()
    ema.save_hf(engine, None, tmp / f"ema{stage}")
    same = forward_loss() == loss_before
    if rank == 0:
        from safetensors.torch import load_file

        saved = load_file(str(tmp / f"ema{stage}" / "model.safetensors"))
        out["saved_diff"] = max(float((saved[n] - ref[n]).abs().max()) for n in ref)
    after = full()
    out["trained_restored"] = all(torch.equal(after[n], now[n]) for n in now)

    ckpt = tmp / f"ckpt{stage}"
    ema.save_checkpoint(str(ckpt), "ds", {})
    dist.barrier()
    fresh = EMA(engine, beta)  # started from the current weights, then loaded
    fresh.load_checkpoint(str(ckpt), "ds")
    out["checkpoint_bit_exact"] = all(torch.equal(fresh.shards[n], ema.shards[n]) for n in ema.shards)
    train_step()  # training goes on after a save

    trained_numel = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    sizes = [None] * world
    dist.all_gather_object(sizes, ema.nbytes())
    out["bytes_per_rank"] = sizes
    out["bytes_total"] = sum(sizes)
    out["trained_numel"] = trained_numel
    flags = [None] * world
    dist.all_gather_object(flags, [out["trained_restored"], out["checkpoint_bit_exact"], same])
    out["trained_restored"] = all(f[0] for f in flags)
    out["checkpoint_bit_exact"] = all(f[1] for f in flags)
    out["loss_after_save_equal"] = all(f[2] for f in flags)
    return out


def _worker(model_dir: str, tmp: str) -> None:
    import torch.distributed as dist

    from learner.runtime import engine as E

    E.init_distributed()
    result = {}
    for stage in (2, 3):  # ZeRO-3 last: its model is built under the HF DeepSpeed config it leaves behind
        result[str(stage)] = _stage(model_dir, stage, Path(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
