"""Reference log-probs and reward-model scores against direct transformers forwards."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from common.protocol import SampleBatch, ScoreRequest
from helpers.reward_models import build_tiny_rm
from reward_service.batching import pad
from reward_service.inputs import BadRequest
from reward_service.ref_model import ReferenceScorer
from reward_service.reward_model import RewardModelError, RewardModelScorer
from reward_service.scorer import RMSource, Scorer

# (prompt length, response length): ragged, with an empty response and a one-token prompt.
SHAPES = [(5, 7), (12, 1), (3, 20), (9, 0), (1, 4), (30, 11), (7, 7)]


def ragged(seed=0):
    g = torch.Generator().manual_seed(seed)
    # ids from 3 up: never the pad / special ids 0..2, so HF's pad-id search finds the true end
    return [(torch.randint(3, 700, (p,), generator=g), torch.randint(3, 700, (r,), generator=g)) for p, r in SHAPES]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A tiny HF sequence-classification RM: the tiny model + a fresh score head."""
    return build_tiny_rm(tiny_model_dir, tmp_path_factory.mktemp("rm") / "hf")


@pytest.fixture(scope="module")
def openrlhf_rm_dir(rm_dir, tmp_path_factory):
    """The same RM in OpenRLHF's layout: head named value_head, mean/std in config.json."""
    out = tmp_path_factory.mktemp("rm") / "openrlhf"
    out.mkdir()
    sd = load_file(rm_dir / "model.safetensors")
    sd["value_head.weight"] = sd.pop("score.weight")
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((rm_dir / "config.json").read_text())
    cfg.update(architectures=["Qwen2RewardModel"], normalize_reward=True, mean=0.25, std=[2.0])
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def direct_logprobs(model, p, r):
    ids = torch.cat([p, r])[None]
    lp = model(ids).logits.float().log_softmax(-1)[0]  # (T, V)
    return lp[len(p) - 1 : len(p) - 1 + len(r)].gather(-1, r[:, None])[:, 0]


def test_ref_logprobs_equal_direct_forward_on_ragged_batches(tiny_model_dir, policy):
    seqs = ragged()
    with torch.no_grad():
        want = [direct_logprobs(policy, p, r) for p, r in seqs]
    prompts, responses = [p for p, _ in seqs], [r for _, r in seqs]
    # "Exact" in fp32 means: equal up to the rounding of different kernel shapes. A padded
    # batch, or even asking for fewer logits rows, can pick another matmul kernel (seen:
    # 4.8e-7 on log-probs around -8); a real mistake -- an off-by-one shift, a position
    # offset from padding, bf16 -- is off by 1e-2 or more.
    for mbs in (1, 3, 16):  # unpadded; ragged micro-batches of 3 (length-sorted, left-padded); all in one
        ref = ReferenceScorer.load(str(tiny_model_dir), micro_batch_size=mbs)
        got = ref.logprobs(prompts, responses)
        assert got.dtype == torch.float32 and got.shape == (sum(len(r) for r in responses),)
        assert (got - torch.cat(want)).abs().max().item() < 1e-5, mbs  # and in the caller's order


def test_ref_temperature_divides_logits(tiny_model_dir, policy):
    ((p, r),) = ragged(1)[:1]
    ref = ReferenceScorer.load(str(tiny_model_dir), temperature=0.7)
    with torch.no_grad():
        lp = (policy(torch.cat([p, r])[None]).logits[0] / 0.7).log_softmax(-1)
    want = lp[len(p) - 1 : -1].gather(-1, r[:, None])[:, 0]
    assert torch.allclose(ref.logprobs([p], [r]), want, atol=1e-6, rtol=0)


def test_rm_scores_equal_direct_forward_left_and_right_padded(rm_dir):
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    seqs = [torch.cat(s) for s in ragged(2)]
    with torch.no_grad():
        want = torch.stack([hf(s[None]).logits[0, 0] for s in seqs])  # unpadded, one by one
        # HF's own padded batch, read at the last non-pad token (its pad-id search).
        ids, mask, _ = pad(seqs, hf.config.pad_token_id, "right")
        hf_batch = hf(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert (hf_batch - want).abs().max() < 1e-5
    for side in ("left", "right"):
        rm = RewardModelScorer.load(str(rm_dir), micro_batch_size=3, padding_side=side)
        got = rm.rewards(seqs)
        assert got.dtype == torch.float32
        assert (got - want).abs().max().item() < 1e-5, side
    rm.micro_batch_size = 1
    assert (rm.rewards(seqs) - want).abs().max().item() < 1e-5  # unpadded


def test_openrlhf_format_value_head_and_normalisation(rm_dir, openrlhf_rm_dir, tmp_path):
    seqs = [torch.cat(s) for s in ragged(3)]
    raw = RewardModelScorer.load(str(rm_dir)).rewards(seqs)
    rm = RewardModelScorer.load(str(openrlhf_rm_dir), normalize=True)
    assert (rm.mean, rm.std) == (0.25, 2.0)
    assert torch.allclose(rm.rewards(seqs), (raw - 0.25) / 2.0, atol=1e-6, rtol=0)
    # A head named in the config (value_head_prefix, as the RM trainer writes it) is found by auto.
    named = tmp_path / "named"
    named.mkdir()
    sd = load_file(openrlhf_rm_dir / "model.safetensors")
    sd["my_head.weight"] = sd.pop("value_head.weight")
    save_file(sd, named / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((openrlhf_rm_dir / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**cfg, "value_head_prefix": "my_head"}))
    assert torch.allclose(RewardModelScorer.load(str(named)).rewards(seqs), raw, atol=1e-6, rtol=0)
    with pytest.raises(RewardModelError, match=r"config.json has no numeric 'mean'"):
        RewardModelScorer.load(str(rm_dir), normalize=True)
    with pytest.raises(RewardModelError, match=r"no reward head found \(looked for reward\.weight\)"):
        RewardModelScorer.load(str(rm_dir), value_head_prefix="reward")


def test_bf16_models_return_float32_close_to_fp32(tiny_model_dir, rm_dir):
    seqs = ragged(4)
    prompts, responses = [p for p, _ in seqs], [r for _, r in seqs]
    lp32 = ReferenceScorer.load(str(tiny_model_dir)).logprobs(prompts, responses)
    lp16 = ReferenceScorer.load(str(tiny_model_dir), dtype=torch.bfloat16).logprobs(prompts, responses)
    assert lp16.dtype == torch.float32 and (lp16 - lp32).abs().mean() < 0.1
    full = [torch.cat(s) for s in seqs]
    r16 = RewardModelScorer.load(str(rm_dir), dtype=torch.bfloat16).rewards(full)
    assert r16.dtype == torch.float32 and torch.isfinite(r16).all()


def test_scorer_combines_ref_and_rm_columnar(tiny_model_dir, rm_dir, policy):
    seqs = ragged(5)
    responses = [r for _, r in seqs]
    sb = SampleBatch(
        prompt_ids=list(range(len(seqs))),
        sample_indices=[0] * len(seqs),
        response_lengths=[len(r) for r in responses],
        response_ids=torch.cat(responses).int(),
        prompt_token_ids=[p.tolist() for p, _ in seqs],
    )
    rm = RewardModelScorer.load(str(rm_dir))
    scorer = Scorer(ref=ReferenceScorer.load(str(tiny_model_dir), micro_batch_size=4), sources=[RMSource(rm)])
    out = scorer.score(ScoreRequest(samples=sb))
    with torch.no_grad():
        want_lp = torch.cat([direct_logprobs(policy, p, r) for p, r in seqs])
    assert out.ref_logprobs.shape == (sum(sb.response_lengths),)
    assert (out.ref_logprobs - want_lp).abs().max() < 1e-5
    assert torch.allclose(out.rewards, rm.rewards([torch.cat(s) for s in seqs]), atol=1e-5, rtol=0)
    assert out.failed == [None] * len(seqs) and out.prompt_ids == sb.prompt_ids
    assert scorer.capabilities().sources == ["ref", "rm"]
    no_prompts = SampleBatch(prompt_ids=[0], sample_indices=[0], response_lengths=[1], response_ids=torch.tensor([5]))
    with pytest.raises(BadRequest, match="prompt_token_ids"):
        scorer.score(ScoreRequest(samples=no_prompts))
    # Requests that would crash a forward are the request's fault: BadRequest, not an exception.
    too_big = SampleBatch(
        prompt_ids=[0],
        sample_indices=[0],
        response_lengths=[1],
        response_ids=torch.tensor([5000]),
        prompt_token_ids=[[5]],
    )
    with pytest.raises(BadRequest, match=r"token ids span \[5, 5000\], outside the reference model's vocabulary"):
        scorer.score(ScoreRequest(samples=too_big))
    empty = SampleBatch(
        prompt_ids=[3], sample_indices=[0], response_lengths=[1], response_ids=torch.tensor([5]), prompt_token_ids=[[]]
    )
    with pytest.raises(BadRequest, match=r"prompt_token_ids\[0\] is empty \(prompt id 3\)"):
        scorer.score(ScoreRequest(samples=empty))
