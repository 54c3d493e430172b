"""--ds.logits_tile_tokens: the policy's log-probs, entropy, losses and gradients computed tile by
tile (common.tiled_logits) are those of the whole logits, to fp32 rounding.

On the tiny model in fp32, tiles of 5 tokens (the batch's 22 counted tokens: a short last tile)
against 0 (whole logits): ``response_logprobs`` on padded and packed rows with agent action masks
(values and entropy at the policy's tokens; zeros elsewhere), and a PolicyTrainer step (the
old-log-probs pass, the policy loss with the entropy in it, KL to the reference) on every
parameter's gradient, the old log-probs and every metric, with full weights and with LoRA (the
adapters' gradients). ``GradEngine`` (tests/helpers/trainer_fakes.py) stands in for DeepSpeed;
DeepSpeed's ZeRO stages: tests/unit/rl/test_tiled_logprobs_zero.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.controller.types import Rollout, ScoredSample
from learner.rl.experience import collate
from learner.rl.policy_trainer import PolicyTrainer, response_logprobs
from learner.runtime.flags import LoraSection
from learner.runtime.lora import apply_lora

TILE = 5


def _model(model_dir, lora: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        model = apply_lora(model, LoraSection(rank=4, alpha=8))
        torch.manual_seed(1)
        with torch.no_grad():  # peft starts lora_B at 0, where lora_A has no gradient: give both one
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def _rollout() -> Rollout:
    """8 samples of different prompt (1-5) and response (1-6) lengths; every other one an agent
    episode whose environment's tokens (mask 0) are context only."""
    samples = []
    for i in range(8):
        prompt = [5 + i % 3, 6, 7, 11, 13][: 1 + (i * 3) % 5]
        response = torch.tensor([8 + i, 9, 10, 12, 14, 15][: 1 + (i * 5) % 6], dtype=torch.int32)
        n = len(response)
        mask = (torch.arange(n) % 3 != 1) if i % 2 else None
        lp = -0.1 * torch.arange(1, n + 1, dtype=torch.float32)  # "vLLM's" log-probs
        samples.append(
            ScoredSample(i // 2, i % 2, prompt, response, lp, lp - 0.05, float(i % 3), action_mask=mask, turns=i % 2)
        )
    return Rollout(samples, group_size=2)


@pytest.mark.parametrize("packed", [False, True])
def test_tiled_response_logprobs_equal_the_whole_logits(tiny_model_dir, packed):
    model = _model(tiny_model_dir)
    batch = collate(_rollout().samples, 0, packed=packed)
    mask = batch["action_mask"]
    assert int(mask.sum()) % TILE and not mask.all()  # a last short tile; masked tokens inside responses
    weight = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    results = {}
    for tile in (0, TILE):
        model.zero_grad()
        lp, ent = response_logprobs(model, batch, 0.7, with_entropy=True, tile_tokens=tile)
        assert ent is not None
        ((lp * weight)[mask].sum() + (ent * weight)[mask].sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results[tile] = lp.detach(), ent.detach(), grads
    (want, want_ent, want_g), (got, got_ent, got_g) = results[0], results[TILE]
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_ent[mask], want_ent[mask], rtol=0, atol=1e-5)
    assert (got[~mask] == 0).all() and (got_ent[~mask] == 0).all()  # as packed rows always had
    for a, b in zip(got_g, want_g, strict=True):  # to 1e-5 of each tensor's largest gradient (some are ~3)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, float(b.abs().max())))
    with torch.no_grad():  # the no-grad passes (old log-probs): the same numbers
        nograd, _ = response_logprobs(model, batch, 0.7, tile_tokens=TILE)
    torch.testing.assert_close(nograd, got, rtol=0, atol=1e-6)


def _step(model_dir, tile: int, packed: bool, lora: bool, **kw):
    cfg = small_ppo_config(model_dir, generate_max_len=6, packing_samples=packed, logits_tile_tokens=tile, **kw)
    engine = GradEngine(_model(model_dir, lora), cfg.train.batch_size // cfg.train.micro_batch_size)
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu"))
    result = trainer.step(_rollout(), on_policy=False)  # the old-log-probs pass runs too
    return engine, result


@pytest.mark.parametrize(
    "packed, lora, kw",
    [
        (False, False, dict(entropy_loss_coef=0.01, init_kl_coef=0.05, is_correction="tis")),
        (True, False, dict(use_kl_loss=True, init_kl_coef=0.1, kl_estimator="k3", loss_agg_mode="seq_mean_token_mean")),
        (False, True, dict(entropy_loss_coef=0.01)),
        (True, True, dict(policy_loss_type="gspo", loss_agg_mode="seq_mean_token_mean")),
    ],
)
def test_a_tiled_step_gives_the_whole_logits_gradients_and_metrics(tiny_model_dir, packed, lora, kw):
    whole, r_whole = _step(tiny_model_dir, 0, packed, lora, **kw)
    tiled, r_tiled = _step(tiny_model_dir, TILE, packed, lora, **kw)
    trained = [p.requires_grad for p in whole.module.parameters()]
    assert not lora or not all(trained)  # LoRA: the adapters only
    got, want = tiled.grads(), whole.grads()
    for a, b, t in zip(got, want, trained, strict=True):
        if t:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, float(b.abs().max())))
    assert any(g.abs().max() > 0 for g in got)
    mask = collate(_rollout().samples, 0)["action_mask"]
    torch.testing.assert_close(r_tiled.old_logprobs[mask], r_whole.old_logprobs[mask], rtol=0, atol=1e-5)
    assert r_tiled.metrics.keys() == r_whole.metrics.keys()
    for k, v in r_whole.metrics.items():
        assert r_tiled.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-5), k
