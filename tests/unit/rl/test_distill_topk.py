"""Top-k distillation in the training pass (--distill_topk K): the student's logits at the
teacher's ids come out of the same forward as the log-probs, whole or tiled, padded or packed,
and the step adds coef * agg(JSD) as a loss term. On the tiny model in fp32 with ``GradEngine``
(tests/helpers/trainer_fakes.py) standing in for DeepSpeed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.controller.types import Rollout, ScoredSample
from learner.rl.experience import collate
from learner.rl.policy_trainer import PolicyTrainer, response_forward

K, TILE = 4, 5


def _model(model_dir) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _rollout(vocab: int) -> Rollout:
    """8 samples of ragged prompts and responses, every other one an agent episode (environment
    tokens masked), each with a teacher's log-probs and its top-K ids and log-probs."""
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(8):
        prompt = [5 + i % 3, 6, 7, 11, 13][: 1 + (i * 3) % 5]
        response = torch.tensor([8 + i, 9, 10, 12, 14, 15][: 1 + (i * 5) % 6], dtype=torch.int32)
        n = len(response)
        mask = (torch.arange(n) % 3 != 1) if i % 2 else None
        lp = -0.1 * torch.arange(1, n + 1, dtype=torch.float32)
        s = ScoredSample(i // 2, i % 2, prompt, response, lp, None, float(i % 3), action_mask=mask, turns=i % 2)
        s.teacher_logprobs = lp - 0.2
        s.teacher_topk_ids = torch.stack([torch.randperm(vocab, generator=g)[:K] for _ in range(n)]).int()
        s.teacher_topk_logprobs = (torch.randn(n, K, generator=g) * 2).log_softmax(-1) - 1.0
        samples.append(s)
    return Rollout(samples, group_size=2)


@pytest.mark.parametrize("packed", [False, True])
def test_the_students_logits_at_the_teachers_ids_whole_or_tiled(tiny_model_dir, packed):
    model = _model(tiny_model_dir)
    vocab = model.config.vocab_size
    batch = collate(_rollout(vocab).samples, 0, packed=packed)
    mask, ids = batch["action_mask"], batch["teacher_topk_ids"]
    # the direct forward, sample by sample: logits at position P-1+t predict response token t
    want = torch.zeros(ids.shape)
    with torch.no_grad():
        for i, s in enumerate(_rollout(vocab).samples):
            seq = torch.tensor([*s.prompt, *s.response.tolist()])
            z = model(seq[None]).logits[0, len(s.prompt) - 1 : len(s.prompt) - 1 + len(s.response)]  # (n, V)
            want[i, : len(s.response)] = z.gather(-1, ids[i, : len(s.response)])
    want = torch.where(mask[..., None], want, torch.zeros_like(want))
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    grads = {}
    for tile in (0, TILE):
        model.zero_grad()
        lp, _, top = response_forward(model, batch, 0.7, tile_tokens=tile, topk_ids=ids)
        assert top is not None and top.shape == ids.shape
        torch.testing.assert_close(top.detach(), want, rtol=0, atol=1e-5)
        (top * w).sum().backward()
        grads[tile] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[TILE], grads[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, float(b.abs().max())))


def _step(model_dir, tile: int, packed: bool, **kw):
    cfg = small_ppo_config(
        model_dir,
        generate_max_len=6,
        packing_samples=packed,
        logits_tile_tokens=tile,
        teacher_pretrain="teacher",
        distill_topk=K,
        **kw,
    )
    model = _model(model_dir)
    engine = GradEngine(model, cfg.train.batch_size // cfg.train.micro_batch_size)
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu"))
    return engine, trainer.step(_rollout(model.config.vocab_size), on_policy=False)


@pytest.mark.parametrize("packed", [False, True])
def test_a_topk_step_is_a_loss_term_whole_or_tiled(tiny_model_dir, packed):
    whole, r_whole = _step(tiny_model_dir, 0, packed, distill_jsd_beta=0.5)
    tiled, r_tiled = _step(tiny_model_dir, TILE, packed, distill_jsd_beta=0.5)
    for a, b in zip(tiled.grads(), whole.grads(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, float(b.abs().max())))
    m = r_whole.metrics
    assert m["policy/distill_topk_divergence"] > 0 and m["policy/distill_topk_loss"] > 0
    assert m["distill/advantage_abs"] == 0  # the sampled-token term is measured, not added
    for k, v in m.items():
        assert r_tiled.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-5), k


def test_a_teacher_equal_to_the_student_over_the_whole_vocabulary_gives_no_divergence(tiny_model_dir):
    """K = V and the teacher's log-probs the student's own (at the sampling temperature): the
    divergence is 0, so with rewards all equal (GRPO's advantage 0) the step has no gradient."""
    model = _model(tiny_model_dir)
    vocab = model.config.vocab_size
    r = _rollout(vocab)
    for s in r.samples:
        seq = torch.tensor([*s.prompt, *s.response.tolist()])
        with torch.no_grad():
            z = model(seq[None]).logits[0, len(s.prompt) - 1 : len(s.prompt) - 1 + len(s.response)]
        s.teacher_topk_logprobs = (z / 1.0).log_softmax(-1)  # (n, V)
        s.teacher_topk_ids = torch.arange(vocab).expand(len(s.response), vocab).int()
        s.reward = 1.0
    cfg = small_ppo_config(tiny_model_dir, generate_max_len=6, teacher_pretrain="t", distill_topk=vocab)
    engine = GradEngine(model, cfg.train.batch_size // cfg.train.micro_batch_size)
    result = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu")).step(r, on_policy=False)
    assert result.metrics["policy/distill_topk_divergence"] == pytest.approx(0.0, abs=1e-6)
    assert max(float(g.abs().max()) for g in engine.grads()) < 1e-5


def test_samples_without_enough_top_k_are_named(tiny_model_dir):
    model = _model(tiny_model_dir)
    r = _rollout(model.config.vocab_size)
    cfg = small_ppo_config(tiny_model_dir, generate_max_len=6, teacher_pretrain="t", distill_topk=K + 1)
    trainer = PolicyTrainer(GradEngine(model, 2), cfg, pad_id=0, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match=rf"carry the teacher's top-{K} \(reward_service --teacher_topk {K + 1}"):
        trainer.step(r, on_policy=False)
