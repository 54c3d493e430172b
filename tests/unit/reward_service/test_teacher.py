"""A teacher in the reward service (on-policy distillation): its log-probs beside the
reference's, the same code on another checkpoint; its tokenizer checked against the policy's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.protocol import SampleBatch, ScoreRequest
from common.vocab import check_same_tokenizer
from helpers.teacher_models import build_foreign_tokenizer_teacher, build_perturbed_teacher
from reward_service.config import parse_config
from reward_service.scorer import Scorer

SHAPES = [(5, 7), (12, 1), (3, 9), (9, 0), (1, 4)]


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    return build_perturbed_teacher(tiny_model_dir, tmp_path_factory.mktemp("teacher") / "model")


def direct_logprobs(model, p, r):
    ids = torch.cat([p, r])[None]
    lp = model(ids).logits.float().log_softmax(-1)[0]  # (T, V)
    return lp[len(p) - 1 : len(p) - 1 + len(r)].gather(-1, r[:, None])[:, 0]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randint(3, 700, (p,), generator=g), torch.randint(3, 700, (r,), generator=g)) for p, r in SHAPES]
    sb = SampleBatch(
        prompt_ids=list(range(len(seqs))),
        sample_indices=[0] * len(seqs),
        response_lengths=[r for _, r in SHAPES],
        response_ids=torch.cat([r for _, r in seqs]).int(),
        prompt_token_ids=[p.tolist() for p, _ in seqs],
    )
    return seqs, sb


def test_reference_and_teacher_in_one_service(tiny_model_dir, teacher_dir):
    cfg = parse_config(
        ["--controller", "-", "--ref_pretrain", str(tiny_model_dir), "--teacher_pretrain", str(teacher_dir)]
    )
    scorer = Scorer.from_config(cfg)
    try:
        caps = scorer.capabilities()
        assert caps.sources == ["ref", "teacher"] and caps.teacher_logprobs and caps.ref_logprobs
        assert not caps.rewards
        seqs, sb = batch()
        out = scorer.score(ScoreRequest(samples=sb))
    finally:
        scorer.close()
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want_ref = torch.cat([direct_logprobs(student, p, r) for p, r in seqs])
        want_teacher = torch.cat([direct_logprobs(teacher, p, r) for p, r in seqs])
    assert out.teacher_logprobs is not None and out.teacher_logprobs.shape == (sum(sb.response_lengths),)
    assert (out.ref_logprobs - want_ref).abs().max() < 1e-5
    assert (out.teacher_logprobs - want_teacher).abs().max() < 1e-5
    # a teacher that differs from the student: the mean k1 reverse KL on these tokens is not 0
    assert (out.ref_logprobs - out.teacher_logprobs).abs().mean() > 0.05
    assert torch.equal(out.rewards, torch.zeros(len(SHAPES)))  # no reward source: rewards 0


def test_a_teacher_alone_is_a_service(teacher_dir):
    cfg = parse_config(["--controller", "-", "--teacher_pretrain", str(teacher_dir)])
    assert cfg.tokenizer_path() == str(teacher_dir)
    scorer = Scorer.from_config(cfg)
    try:
        assert scorer.capabilities().sources == ["teacher"]
        _, sb = batch(1)
        out = scorer.score(ScoreRequest(samples=sb))
        assert out.ref_logprobs is None and out.teacher_logprobs.shape == (sum(sb.response_lengths),)
        no_prompts = SampleBatch(
            prompt_ids=[0], sample_indices=[0], response_lengths=[1], response_ids=torch.tensor([5])
        )
        from reward_service.inputs import BadRequest

        with pytest.raises(BadRequest, match="teacher log-probs need samples.prompt_token_ids"):
            scorer.score(ScoreRequest(samples=no_prompts))
    finally:
        scorer.close()


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_model_dir, tmp_path):
    foreign = build_foreign_tokenizer_teacher(tiny_model_dir, tmp_path / "foreign")
    with pytest.raises(
        ValueError, match=r"teacher --teacher_pretrain .*foreign does not share the student's tokenizer"
    ):
        check_same_tokenizer(str(tiny_model_dir), str(foreign))
    cfg = parse_config(["--controller", "-", "--tokenizer", str(tiny_model_dir), "--teacher_pretrain", str(foreign)])
    with pytest.raises(ValueError, match=rf"\(--tokenizer {tiny_model_dir}\)"):
        Scorer.from_config(cfg)
    check_same_tokenizer(str(tiny_model_dir), str(tiny_model_dir))  # the same path: nothing to read


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--teacher_backend", "vllm", "--ref_pretrain", "x"], "--teacher_backend vllm serves the teacher"),
        (
            ["--teacher_pretrain", "x", "--teacher_backend", "vllm", "--temperature", "0.7"],
            "--teacher_backend vllm reads log-probs from the raw logits",
        ),
        (
            ["--teacher_pretrain", "x", "--teacher_backend", "vllm", "--teacher_gpu_memory_utilization", "1.5"],
            "--teacher_gpu_memory_utilization must be in",
        ),
        (["--ref_pretrain", "x", "--teacher_topk", "4"], "--teacher_topk returns a teacher's top-k"),
        (["--teacher_pretrain", "x", "--teacher_topk", "-1"], "--teacher_topk must be >= 0"),
        (
            ["--teacher_pretrain", "x", "--teacher_backend", "vllm", "--teacher_topk", "4"],
            "--teacher_topk is served by --teacher_backend hf only",
        ),
    ],
)
def test_teacher_flags_are_checked(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["--controller", "-", *argv])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("tile", [0, 4])
def test_teacher_topk_equals_a_direct_forward(teacher_dir, tile):
    """``--teacher_topk K``: the K most likely ids and their log-probs at every response position,
    most likely first, whole logits or tiles of 4 rows; the sampled tokens' log-probs as without."""
    from reward_service.ref_model import ReferenceScorer

    seqs, _ = batch(2)
    prompts, responses = [p for p, _ in seqs], [r for _, r in seqs]
    scorer = ReferenceScorer.load(str(teacher_dir), micro_batch_size=2, tile_tokens=tile, temperature=0.8)
    lp, ids, lps = scorer.topk(prompts, responses, 5)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = []
        for p, r in seqs:
            lg = model(torch.cat([p, r])[None]).logits[0].float() / 0.8
            rows.append(lg.log_softmax(-1)[len(p) - 1 : len(p) - 1 + len(r)])  # (n, V)
        full = torch.cat(rows)  # (L, V)
    labels = torch.cat(responses).long()
    assert ids.dtype == torch.int32 and ids.shape == lps.shape == (len(labels), 5)
    torch.testing.assert_close(lp, full.gather(-1, labels[:, None])[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp, scorer.logprobs(prompts, responses), atol=1e-6, rtol=0)
    want_lps, want_ids = full.topk(5, dim=-1)
    torch.testing.assert_close(lps, want_lps, atol=1e-5, rtol=0)
    assert torch.equal(ids.long(), want_ids)
    assert torch.all(lps[:, :-1] >= lps[:, 1:])  # most likely first
    with pytest.raises(ValueError, match=r"must be in \[1, "):
        scorer.topk(prompts, responses, 10**6)


def test_a_service_with_teacher_topk(tiny_model_dir, teacher_dir):
    cfg = parse_config(["--controller", "-", "--teacher_pretrain", str(teacher_dir), "--teacher_topk", "3"])
    scorer = Scorer.from_config(cfg)
    try:
        assert scorer.capabilities().teacher_topk == 3
        _, sb = batch(3)
        out = scorer.score(ScoreRequest(samples=sb))
    finally:
        scorer.close()
    L = sum(sb.response_lengths)
    assert out.teacher_logprobs.shape == (L,) and out.teacher_topk_ids.shape == out.teacher_topk_logprobs.shape == (
        L,
        3,
    )
    # over the wire: the (L, K) tensors survive encoding
    from common.protocol import Codec

    codec = Codec()
    back = codec.decode(codec.encode(out))
    assert torch.equal(torch.as_tensor(back.teacher_topk_ids), out.teacher_topk_ids)
    assert torch.equal(torch.as_tensor(back.teacher_topk_logprobs), out.teacher_topk_logprobs)
    too_many = parse_config(["--controller", "-", "--teacher_pretrain", str(teacher_dir), "--teacher_topk", "100000"])
    with pytest.raises(ValueError, match="--teacher_topk 100000 is more ids than the teacher's vocabulary"):
        Scorer.from_config(too_many)
