"""On-policy distillation's part of a step (learner.rl.distill_term): the teacher's term in the
advantages (group estimators) or the token rewards (gae), by hand; the flags; the broadcast."""

from __future__ import annotations

import pytest
import torch

from common.config import build
from learner.algorithms.advantages import compute_advantages
from learner.controller.types import Rollout, ScoredSample
from learner.rl.config import PPOConfig
from learner.rl.distill_term import DistillTerm
from learner.rl.experience import _pack, _unpack, collate

BASE = dict(
    pretrain="m",
    prompt_data="p",
    rollout_batch_size=1,
    train_batch_size=2,
    micro_train_batch_size=1,
    n_samples_per_prompt=2,
)


def rollout(teacher=True, action_mask=None):
    # two samples of one prompt, responses of 2 and 3 tokens; the teacher's log-probs by hand
    samples = [
        ScoredSample(0, 0, [1], torch.tensor([4, 5], dtype=torch.int32), torch.zeros(2), None, 0.0),
        ScoredSample(0, 1, [1], torch.tensor([6, 7, 8], dtype=torch.int32), torch.zeros(3), None, 0.0),
    ]
    if teacher:
        samples[0].teacher_logprobs = torch.tensor([-1.0, -2.0])
        samples[1].teacher_logprobs = torch.tensor([-0.5, -0.5, -3.0])
    if action_mask is not None:
        samples[1].action_mask, samples[1].turns = action_mask, 2
    return Rollout(samples, group_size=2)


OLD_LP = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -1.5, -2.0]])  # (N, T); the learner's, row 0 padded at t = 2
# d_t = -(old - teacher): row 0: -(-1.5 + 1) = 0.5, -(-1 + 2) = -1, pad 0; row 1: 0, 1, -1
D = torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, -1.0]])


def test_pure_distillation_with_a_group_estimator_is_coef_times_d():
    r = rollout()
    full = collate(r.samples, 0)
    mask = full["action_mask"]
    term = DistillTerm.of(r, full["teacher_logprobs"], OLD_LP, mask, coef=0.5, in_reward=False)
    torch.testing.assert_close(term.advantage, D)
    # no reward source: rewards 0, GRPO's group advantage 0, so A = 0.5 d
    adv, _ = compute_advantages("group_norm", torch.zeros(2), mask, group_size=2)
    torch.testing.assert_close(term.add_to(adv), 0.5 * D)
    m = term.metrics(mask)
    # reverse KL = -d: tokens -0.5, 1, 0, -1, 1 -> mean 0.5 / 5 = 0.1; per sample 0.5 and 0 -> 0.25
    assert m["distill/reverse_kl"] == pytest.approx(0.1)
    assert m["distill/reverse_kl_seq"] == pytest.approx(0.25)
    assert m["distill/advantage_abs"] == pytest.approx(0.5 * 3.5 / 5)


def test_with_task_rewards_the_term_is_added_after_the_group_normalisation():
    r = rollout()
    full = collate(r.samples, 0)
    mask = full["action_mask"]
    term = DistillTerm.of(r, full["teacher_logprobs"], OLD_LP, mask, coef=2.0, in_reward=False)
    # rewards (1, 0): GRPO r' = (r - 0.5) / std, std (unbiased) = 0.7071 -> +-0.7071 on every token
    adv, _ = compute_advantages("group_norm", torch.tensor([1.0, 0.0]), mask, group_size=2)
    want = torch.tensor([[0.7071, 0.7071, 0.0], [-0.7071, -0.7071, -0.7071]]) + 2.0 * D
    torch.testing.assert_close(term.add_to(adv), want, atol=1e-4, rtol=0)


def test_under_gae_the_term_is_a_token_reward():
    r = rollout()
    full = collate(r.samples, 0)
    mask = full["action_mask"]
    term = DistillTerm.of(r, full["teacher_logprobs"], OLD_LP, mask, coef=1.0, in_reward=True)
    kl = torch.tensor([[0.1, 0.2, 0.0], [0.0, 0.0, 0.4]])
    penalty, one = term.token_penalty(kl, kl_coef=0.5)
    assert one == 1.0
    # penalty = 0.5 kl - d; the token reward -penalty = -0.5 kl + d
    torch.testing.assert_close(penalty, 0.5 * kl - D)
    # values 0, gamma = lambda = 1: GAE_t = sum of the rewards from t on; rewards (1, 0) at the last token
    # row 0: R = (-0.05 + 0.5, -0.1 - 1 + 1) = (0.45, -0.1): returns (0.35, -0.1)
    # row 1: R = (0, 1, -0.2 - 1 + 0) = (0, 1, -1.2): returns (-0.2, -0.2, -1.2)
    _, returns = compute_advantages(
        "gae", torch.tensor([1.0, 0.0]), mask, values=torch.zeros(2, 3), kl=penalty, kl_coef=one, gamma=1.0, lambd=1.0
    )
    torch.testing.assert_close(returns, torch.tensor([[0.35, -0.1, 0.0], [-0.2, -0.2, -1.2]]))


def test_centred_by_default_in_a_step_and_raw_when_asked():
    r = rollout()
    full = collate(r.samples, 0)
    mask = full["action_mask"]
    term = DistillTerm.of(r, full["teacher_logprobs"], OLD_LP, mask, coef=1.0, in_reward=False, center=True)
    # D's trained tokens: 0.5, -1, 0, 1, -1 -> mean -0.1
    torch.testing.assert_close(term.advantage, torch.tensor([[0.6, -0.9, 0.0], [0.1, 1.1, -0.9]]))
    assert term.metrics(mask)["distill/reverse_kl"] == pytest.approx(0.1)  # the KL itself is not centred
    assert build(PPOConfig, **BASE, teacher_pretrain="t").algo.distill.center
    assert not build(PPOConfig, **BASE, teacher_pretrain="t", distill_center=False).algo.distill.center


def test_action_mask_keeps_environment_tokens_out():
    am = torch.tensor([True, False, True])  # the middle token is the environment's
    r = rollout(action_mask=am)
    full = collate(r.samples, 0)
    mask = full["action_mask"]
    term = DistillTerm.of(r, full["teacher_logprobs"], OLD_LP, mask, coef=1.0, in_reward=False)
    torch.testing.assert_close(term.advantage, torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, -1.0]]))


def test_a_sample_without_teacher_log_probs_is_named():
    r = rollout(teacher=False)
    full = collate(r.samples, 0)
    with pytest.raises(RuntimeError, match="every reward service started with --teacher_pretrain"):
        DistillTerm.of(r, full["teacher_logprobs"], OLD_LP, full["action_mask"], coef=1.0, in_reward=False)


def test_teacher_log_probs_cross_the_broadcast():
    r = rollout()
    back = _unpack([t.clone() for t in _pack(r)], 2)
    for a, b in zip(r.samples, back.samples, strict=True):
        torch.testing.assert_close(a.teacher_logprobs, b.teacher_logprobs)
    plain = _unpack([t.clone() for t in _pack(rollout(teacher=False))], 2)
    assert all(s.teacher_logprobs is None for s in plain.samples)


def test_flags_dotted_and_flat():
    cfg = build(PPOConfig, **BASE, advantage_estimator="group_norm", teacher_pretrain="t", distill_coef=0.3)
    assert cfg.distill and cfg.teacher.model_name_or_path == "t" and cfg.algo.distill.coef == 0.3
    assert not build(PPOConfig, **BASE).distill
    with pytest.raises(ValueError, match="--distill_topk is a setting of on-policy distillation"):
        build(PPOConfig, **BASE, distill_topk=4)
    assert build(PPOConfig, **BASE, teacher_pretrain="t", distill_topk=4).algo.distill.topk == 4
    with pytest.raises(ValueError, match="--distill_topk 4 is not built for a sequence split"):
        build(PPOConfig, **BASE, teacher_pretrain="t", distill_topk=4, ring_attn_size=2)
    with pytest.raises(ValueError, match="--distill_coef must be >= 0"):
        build(PPOConfig, **BASE, teacher_pretrain="t", distill_coef=-1.0)
    with pytest.raises(ValueError, match="--distill_jsd_beta must be in"):
        build(PPOConfig, **BASE, teacher_pretrain="t", distill_jsd_beta=2.0)


def test_dotted_spelling_on_the_command_line():
    from common.config import parse

    cfg = parse(
        PPOConfig,
        [
            "--actor.model_name_or_path", "m", "--data.prompt_dataset", "p", "--rollout.batch_size", "1",
            "--train.batch_size", "2", "--train.micro_batch_size", "1", "--rollout.n_samples_per_prompt", "2",
            "--algo.advantage.estimator", "rloo", "--teacher.model_name_or_path", "t", "--algo.distill.coef", "0.5",
        ],
    )  # fmt: skip
    assert cfg.teacher.model_name_or_path == "t" and cfg.algo.distill.coef == 0.5


def test_the_learner_refuses_a_teacher_of_another_tokenizer_at_start_up(tiny_model_dir, tmp_path):
    """``load_data`` (every rank, before any model loads) names both paths; a teacher of the same
    tokenizer passes."""
    import json

    from helpers.teacher_models import build_foreign_tokenizer_teacher
    from learner.rl.build import RunError
    from learner.rl.run import Process, load_data

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(4)))
    proc = Process(0, 1, torch.device("cpu"))
    base = dict(BASE, pretrain=str(tiny_model_dir), prompt_data=str(data))
    foreign = build_foreign_tokenizer_teacher(tiny_model_dir, tmp_path / "foreign")
    with pytest.raises(RunError, match=rf"teacher --teacher_pretrain {foreign} does not share .*--pretrain"):
        load_data(build(PPOConfig, **base, teacher_pretrain=str(foreign)), proc)
    assert load_data(build(PPOConfig, **base, teacher_pretrain=str(tiny_model_dir)), proc).n_prompts == 4


def test_the_learner_needs_a_reward_service_that_serves_the_teacher():
    from types import SimpleNamespace

    from common.protocol import RewardCapabilities
    from learner.rl.build import RunError, check_reward_sources

    cfg = build(PPOConfig, **BASE, teacher_pretrain="t", init_kl_coef=0.0)
    plain = SimpleNamespace(name="reward-0", capabilities=RewardCapabilities(sources=["func:f.py"]))
    with pytest.raises(RunError, match="start a reward service with --teacher_pretrain t"):
        check_reward_sources(cfg, [plain])
    served = SimpleNamespace(name="reward-1", capabilities=RewardCapabilities(sources=["teacher"]))
    check_reward_sources(cfg, [plain, served])
    topk = build(PPOConfig, **BASE, teacher_pretrain="t", init_kl_coef=0.0, distill_topk=8)
    with pytest.raises(RunError, match=r"reward_service --teacher_topk 8\); these serve fewer .*'reward-1': 0"):
        check_reward_sources(topk, [served])
    eight = SimpleNamespace(name="reward-2", capabilities=RewardCapabilities(sources=["teacher"], teacher_topk=8))
    check_reward_sources(topk, [eight])


def test_teacher_topk_crosses_the_broadcast_and_collates_to_n_t_k():
    r = rollout()
    for s in r.samples:
        t = len(s.response)
        s.teacher_topk_ids = torch.arange(t * 3, dtype=torch.int32).reshape(t, 3)
        s.teacher_topk_logprobs = -torch.arange(t * 3, dtype=torch.float32).reshape(t, 3)
    back = _unpack([t.clone() for t in _pack(r)], 2)
    for a, b in zip(r.samples, back.samples, strict=True):
        assert torch.equal(a.teacher_topk_ids, b.teacher_topk_ids) and b.teacher_topk_ids.dtype == torch.int32
        torch.testing.assert_close(a.teacher_topk_logprobs, b.teacher_topk_logprobs)
    full = collate(back.samples, 0)
    assert full["teacher_topk_ids"].shape == full["teacher_topk_logprobs"].shape == (2, 3, 3)
    assert full["teacher_topk_ids"][0, 1].tolist() == [3, 4, 5] and full["teacher_topk_ids"][0, 2].tolist() == [0, 0, 0]
    assert "teacher_topk_ids" not in collate(rollout().samples, 0)  # none asked: no key


def _broadcast_worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from learner.rl.experience import broadcast_rollout

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        src = None
        if rank == 0:
            src = rollout()
            for s in src.samples:
                t = len(s.response)
                s.teacher_topk_ids = torch.arange(t * 2, dtype=torch.int32).reshape(t, 2) + 7
                s.teacher_topk_logprobs = -torch.arange(t * 2, dtype=torch.float32).reshape(t, 2)
        got = broadcast_rollout(src, 2)
        if rank == 1:
            torch.save([(s.teacher_logprobs, s.teacher_topk_ids, s.teacher_topk_logprobs) for s in got.samples], out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch: ~18 s
def test_a_teacher_s_log_probs_and_top_k_reach_another_rank(tmp_path):
    """``broadcast_rollout`` over 2 gloo ranks: rank 1 gets rank 0's teacher tensors."""
    import torch.multiprocessing as mp

    out = tmp_path / "rank1.pt"
    mp.spawn(_broadcast_worker, args=(f"file://{tmp_path / 'store'}", str(out)), nprocs=2, join=True)
    got = torch.load(out)
    want = rollout()
    for (lp, ids, lps), s in zip(got, want.samples, strict=True):
        t = len(s.response)
        torch.testing.assert_close(lp, s.teacher_logprobs)
        assert ids.dtype == torch.int32 and torch.equal(ids, torch.arange(t * 2, dtype=torch.int32).reshape(t, 2) + 7)
        torch.testing.assert_close(lps, -torch.arange(t * 2, dtype=torch.float32).reshape(t, 2))
