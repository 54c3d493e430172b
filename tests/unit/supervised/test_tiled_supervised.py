"""--ds.logits_tile_tokens in the supervised trainers: SFT's loss and DPO's summed log-probs, tiled
(``learner.runtime.models.label_logprobs`` through common.tiled_logits), equal the whole logits'
with their gradients, on padded and packed rows, full weights and LoRA, tiles of 4 dividing no
row's count of counted tokens (the tiny model, fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.algorithms.sft_loss import IGNORE_INDEX, sft_loss, sft_loss_of_logprobs
from learner.runtime.flags import LoraSection
from learner.runtime.lora import apply_lora
from learner.runtime.models import label_logprobs, sequence_logprobs

TILE = 4
# (prompt, response) lengths of three samples
SHAPES = [(3, 5), (1, 2), (4, 6)]


def _samples() -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of each sample."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(3, 500, (p + r,), generator=g).tolist(), p) for p, r in SHAPES]


def _labels(ids: list[int], prompt: int) -> list[int]:
    # labels[t] = ids[t + 1] for response tokens, IGNORE for the prompt's and the sample's last position
    return [ids[t + 1] if t + 1 >= prompt and t + 1 < len(ids) else IGNORE_INDEX for t in range(len(ids))]


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    rows = [(ids, _labels(ids, p)) for ids, p in _samples()]
    if packed:
        return {
            "input_ids": torch.tensor([[t for ids, _ in rows for t in ids]]),
            "position_ids": torch.tensor([[i for ids, _ in rows for i in range(len(ids))]]),
            "labels": torch.tensor([[y for _, lab in rows for y in lab]]),
        }
    width = max(len(ids) for ids, _ in rows)
    out = {
        "input_ids": torch.zeros(len(rows), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
        "labels": torch.full((len(rows), width), IGNORE_INDEX),
    }
    for i, (ids, lab) in enumerate(rows):
        out["input_ids"][i, : len(ids)] = torch.tensor(ids)
        out["attention_mask"][i, : len(ids)] = 1
        out["labels"][i, : len(ids)] = torch.tensor(lab)
    return out


def _model(model_dir, lora: bool):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        model = apply_lora(model, LoraSection(rank=4, alpha=8))
        with torch.no_grad():  # lora_B starts at 0, where lora_A has no gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def _close_grads(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    assert any(g is not None and g.abs().max() > 0 for g in got)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("packed", [False, True])
def test_sft_loss_tiled_equals_whole_logits(tiny_model_dir, packed):
    model = _model(tiny_model_dir, lora=False)
    batch = _batch(packed)
    n = int((batch["labels"] != IGNORE_INDEX).sum())
    assert n % TILE  # a short last tile
    results = []
    for tile in (0, TILE):
        model.zero_grad()
        logp = label_logprobs(model, batch, tile_tokens=tile)
        loss, m = sft_loss_of_logprobs(logp, batch["labels"], global_tokens=n)
        loss.backward()
        results.append((loss.detach(), m, [p.grad.clone() for p in model.parameters()]))
    (whole, m_whole, g_whole), (tiled, m_tiled, g_tiled) = results
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    assert whole.item() == pytest.approx(sft_loss(logits, batch["labels"], global_tokens=n)[0].item(), rel=1e-6)
    assert tiled.item() == pytest.approx(whole.item(), rel=1e-6)
    assert m_tiled["tokens"] == m_whole["tokens"] == n
    _close_grads(g_tiled, g_whole)


@pytest.mark.parametrize("lora", [False, True])
def test_dpo_sequence_logprobs_tiled_equal_whole_logits(tiny_model_dir, lora):
    model = _model(tiny_model_dir, lora)
    batch = _batch(packed=False)
    weight = torch.tensor([1.0, -2.0, 0.5])
    results = []
    for tile in (0, TILE):
        model.zero_grad()
        logp, tokens = sequence_logprobs(model, batch, tile_tokens=tile, packed=False)
        (logp * weight).sum().backward()
        results.append(
            (logp.detach(), tokens, [p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        )
    (whole, t_whole, g_whole), (tiled, t_tiled, g_tiled) = results
    assert t_tiled.tolist() == t_whole.tolist() == [r for _, r in SHAPES]  # a response's tokens, its first included
    torch.testing.assert_close(tiled, whole, rtol=0, atol=1e-5)
    _close_grads(g_tiled, g_whole)
