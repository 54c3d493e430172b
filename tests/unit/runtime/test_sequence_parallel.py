"""Sequence parallelism (``--ds.ring_attn_size``, learner.runtime.sequence_parallel): the split's
pieces by hand, and its exactness on 2 gloo ranks in ONE torchrun launch (issue 41's acceptance).

The launch (slow, one worker per rank, the tiny model in fp32 with SDPA) checks, against the same
computation unsplit:

* ``response_logprobs`` (the policy's log-probs and entropy, the loss on them and every parameter's
  gradient summed over the two ranks) on padded and packed micro-batches, with and without agent
  action masks, tiled (tiles of 3) and whole logits, and a micro-batch whose predicting columns all
  lie in one rank's shard (the other rank has no counted token);
* a whole ``PolicyTrainer.step`` on DeepSpeed engines (ZeRO-2, and ZeRO-3 with gradient
  checkpointing, padded and packed): the policy's gradient as DeepSpeed holds it before its optimizer
  step, and the old log-probs, with the sequence split 2 ways (one data-parallel group) equal those of
  the same step unsplit on the same 2 ranks (2 data-parallel ranks). That is the scale check: DeepSpeed
  is not told about the split, reduces over both ranks and divides by 2, and the trainers' loss scale
  (ranks x accumulation) makes that the sum of the group's shares.

Worker: ``torchrun --nproc_per_node 2 tests/unit/runtime/test_sequence_parallel.py MODEL_DIR``
prints ``RESULT {...}`` on each rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from learner.runtime import sequence_parallel as sp

ROOT = Path(__file__).resolve().parents[3]
# PolicyTrainer steps split vs unsplit: (ZeRO stage, packed, gradient checkpointing, on_policy: the old
# log-probs taken from the training forward, estimator). gae: a critic beside the policy, its values and
# value loss split too. ZeRO-3 last: while a ZeRO-3 model lives, transformers builds every model it loads
# inside zero.Init (HfDeepSpeedConfig).
STEP_CASES = (
    (2, False, False, False, "group_norm"),
    (2, True, False, True, "group_norm"),
    (2, True, False, False, "gae"),
    (3, False, True, False, "group_norm"),
)


# ------------------------------------------------------------------ by hand, one process


def test_segment_causal_mask_keeps_packed_samples_apart():
    # Two samples (3 + 2 tokens) then a pad continuing the second's positions.
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    m = sp.segment_causal_mask(pos)[0, 0].int()
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ]
    )
    assert torch.equal(m, want)
    assert sp.segment_causal_mask(torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])) is None  # one sample a row: causal


def test_split_layout_of_a_padded_micro_batch():
    # Row 0: prompt [5, 6], response [7, 8, 9]; row 1: prompt [4], response [3] (+ padding, 0).
    # collate's layout: P = 2, T = 3, prompts left-padded, responses right-padded.
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [0, 4, 3, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]),
        "response": torch.tensor([[7, 8, 9], [3, 0, 0]]),
        "action_mask": torch.tensor([[True, False, True], [True, False, False]]),  # an agent's env token at 1
        "prompt_width": 2,
    }
    lay = sp.split_layout(batch, 2)
    # Width: the longest row (5) rounded up to 2 -> 6; row 1 from column 0, pads repeat its last token.
    assert lay.input_ids.tolist() == [[5, 6, 7, 8, 9, 9], [4, 3, 3, 3, 3, 3]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    # Counted tokens, row-major: (0, t=0) predicted at column 1, (0, t=2) at 3, (1, t=0) at row 1's 0.
    assert lay.cols.tolist() == [1, 3, 6 + 0]


def test_split_layout_of_a_packed_row_pads_to_the_group():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 4, 3]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
        "logit_index": torch.tensor([1, 2, 4]),
        "action_mask": torch.tensor([[True, True], [True, False]]),
        "response": torch.tensor([[6, 7], [3, 0]]),
    }
    lay = sp.split_layout(batch, 4)
    assert lay.input_ids.tolist() == [[5, 6, 7, 4, 3, 3, 3, 3]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert lay.cols.tolist() == [1, 2, 4]


def test_heads_the_split_cannot_divide_are_refused_naming_the_flag():
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, name_or_path="tiny")
    sp.check_heads(config, 2)
    with pytest.raises(ValueError, match=r"--ds.ring_attn_size .* 4: .* 4 attention heads and 2 KV heads"):
        sp.check_heads(config, 4)


def test_the_flag_and_its_alias():
    from common.config import build
    from learner.rl.config import PPOConfig

    base = dict(pretrain="m", prompt_data="p")
    assert build(PPOConfig, **base).ds.ring_attn_size == 1
    from common.config import parse

    cfg = parse(PPOConfig, ["--pretrain", "m", "--prompt_data", "p", "--ds.sequence_parallel_size", "2"])
    assert cfg.ds.ring_attn_size == 2
    cfg = parse(PPOConfig, ["--pretrain", "m", "--prompt_data", "p", "--ring_attn_size", "2"])
    assert cfg.ds.ring_attn_size == 2 and not any("ring_attn_size" in n for n in cfg.notices)


def test_batch_sizes_count_data_parallel_groups_not_ranks():
    from common.config import build
    from learner.rl.config import PPOConfig

    def cfg(**kw):
        return build(PPOConfig, pretrain="m", prompt_data="p", rollout_batch_size=6, n_samples_per_prompt=2, **kw)

    # 2 ranks split 2 ways are one data-parallel rank: a micro-batch of the whole train batch is fine
    cfg(train_batch_size=12, micro_train_batch_size=12, ring_attn_size=2).check_world_size(2)
    with pytest.raises(ValueError, match=r"x 2 data-parallel ranks \(4 learner ranks / --ds.ring_attn_size 2\)"):
        cfg(train_batch_size=12, micro_train_batch_size=12, ring_attn_size=2).check_world_size(4)
    with pytest.raises(ValueError, match="--ds.ring_attn_size 2 must divide the 3 learner ranks"):
        cfg(train_batch_size=12, micro_train_batch_size=2, ring_attn_size=2).check_world_size(3)


# ------------------------------------------------------------------ 2 ranks


def _samples(agent: bool):
    from learner.controller.types import ScoredSample

    out = []
    for i in range(8):
        prompt = [5 + i % 3, 6, 7, 30][: 1 + i % 4]
        response = torch.tensor([8 + i, 9, 10, 11, 12, 13, 40][: 1 + (i * 5) % 7], dtype=torch.int32)
        lp = -0.1 * torch.arange(1, len(response) + 1, dtype=torch.float32)
        mask = None
        if agent and i % 2 and len(response) > 2:
            mask = torch.ones(len(response), dtype=torch.bool)
            mask[1] = False  # an environment token
        out.append(
            ScoredSample(
                i // 2,
                i % 2,
                prompt,
                response,
                lp,
                lp - 0.05,
                float(i % 3),
                action_mask=mask,
                turns=int(mask is not None),
            )
        )
    return out


def _logprob_cases(model_dir: str, results: dict) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from learner.rl.experience import collate
    from learner.rl.policy_trainer import response_logprobs

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)

    whole, split = load(), load()
    groups = sp.init_groups(2)
    sp.register(split, groups)
    from learner.controller.types import ScoredSample

    # One sample whose response is predicted by columns 8 and 9 of 12: all in rank 1's shard.
    lopsided = [
        ScoredSample(0, 0, list(range(20, 29)), torch.tensor([31, 32], dtype=torch.int32), torch.zeros(2), None, 1.0)
    ]
    cases = {}
    for packed in (False, True):
        for agent in (False, True):
            cases[f"{'packed' if packed else 'padded'}{'_agent' if agent else ''}"] = (_samples(agent), packed, 3)
    cases["padded_whole_logits"] = (_samples(True), False, 0)
    cases["packed_whole_logits"] = (_samples(True), True, 0)
    cases["one_rank_has_no_token"] = (lopsided, False, 3)
    for name, (samples, packed, tile) in cases.items():
        batch = collate(samples, 0, packed=packed)
        mask = batch["action_mask"].float()
        weights = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape) * mask
        out = {}
        for key, model in (("whole", whole), ("split", split)):
            model.zero_grad()
            lp, ent = response_logprobs(model, batch, 0.7, with_entropy=True, entropy_grad=True, tile_tokens=tile)
            loss = (lp * weights).sum() + 0.1 * (ent * mask).sum()
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if key == "split":
                for g in grads.values():  # each rank holds its shard's share
                    dist.all_reduce(g, group=groups.group)
            out[key] = (lp.detach(), ent.detach(), loss.detach(), grads)
        (lp0, ent0, loss0, g0), (lp1, ent1, loss1, g1) = out["whole"], out["split"]
        results[name] = {  # the unsplit whole logits leave values outside the action mask; both count 0 there
            "logprobs": float(((lp1 - lp0) * mask).abs().max()),
            "entropy": float(((ent1 - ent0) * mask).abs().max()),
            "loss": float((loss1 - loss0).abs()),
            "grads": max(float((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp(min=1e-12)) for n in g0),
            "largest_grad": max(float(g.abs().max()) for g in g0.values()),
        }
    _critic_cases(model_dir, groups, results)


def _critic_cases(model_dir: str, groups, results: dict) -> None:
    """The critic's values (``learner.rl.critic.response_values``) and their gradients."""
    import torch.distributed as dist

    from learner.rl.critic import load_critic, response_values
    from learner.rl.experience import collate

    whole, split = load_critic(model_dir), load_critic(model_dir)  # the same fresh head (seeded)
    sp.register(split, groups)
    for packed in (False, True):
        batch = collate(_samples(agent=True), 0, packed=packed)
        mask = batch["action_mask"].float()
        weights = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape) * mask
        out = {}
        for key, model in (("whole", whole), ("split", split)):
            model.zero_grad()
            v = response_values(model, batch)
            (v * weights).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if key == "split":
                for g in grads.values():
                    dist.all_reduce(g, group=groups.group)
            out[key] = (v.detach(), grads)
        (v0, g0), (v1, g1) = out["whole"], out["split"]
        results[f"critic_{'packed' if packed else 'padded'}"] = {
            "values": float(((v1 - v0) * mask).abs().max()),
            "grads": max(float((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp(min=1e-12)) for n in g0),
            "largest_grad": max(float(g.abs().max()) for g in g0.values()),
        }


def _step_cases(model_dir: str, results: dict, cases: tuple = STEP_CASES) -> None:
    from common.config import build
    from learner.controller.types import Rollout
    from learner.rl.config import PPOConfig
    from learner.rl.critic import Critic, load_critic
    from learner.rl.experience import collate
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.runtime import engine as E

    rollout = Rollout(_samples(agent=True), group_size=2)
    for stage, packed, checkpointing, on_policy, estimator in cases:
        got = {}
        for size in (1, 2):
            cfg = build(
                PPOConfig,
                pretrain=model_dir,
                prompt_data="p",
                advantage_estimator=estimator,
                n_samples_per_prompt=2,
                rollout_batch_size=4,
                train_batch_size=8,
                micro_train_batch_size=2,
                micro_rollout_batch_size=2,
                generate_max_len=7,
                init_kl_coef=0.0,
                entropy_loss_coef=0.01,
                zero_stage=stage,
                packing_samples=packed,
                logits_tile_tokens=3,
                ring_attn_size=size,
                seed=0,
            )
            torch.manual_seed(0)
            model = E.load_causal_lm(model_dir, zero_stage=stage, gradient_checkpointing=checkpointing)
            engine = E.make_engine(
                model,
                zero_stage=stage,
                bf16=False,
                train_batch_size=8 * size,  # as learner.rl.build gives it: DeepSpeed counts ranks, not groups
                micro_train_batch_size=2,
                learning_rate=1e-3,
                num_training_steps=10,
                lr_scheduler="constant_with_warmup",
                lr_warmup_ratio=0.0,
            )
            seen: dict[str, torch.Tensor] = {}
            critic = None
            if estimator == "gae":
                critic_engine = E.make_engine(
                    load_critic(model_dir, zero_stage=stage),
                    zero_stage=stage,
                    bf16=False,
                    train_batch_size=8 * size,
                    micro_train_batch_size=2,
                    learning_rate=1e-3,
                    num_training_steps=10,
                    lr_scheduler="constant_with_warmup",
                    lr_warmup_ratio=0.0,
                )
                _read_grads(critic_engine, seen, "critic.")
                cpu = torch.device("cpu")
                critic = Critic(critic_engine, pad_id=0, device=cpu, micro_rollout_batch_size=2, value_clip=0.2)
            _read_grads(engine, seen, "")
            trainer = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu"), critic=critic)
            res = trainer.step(rollout, on_policy=on_policy)
            got[size] = (seen, res.old_logprobs)
        (g0, old0), (g1, old1) = got[1], got[2]
        assert g0.keys() == g1.keys() and g0
        counted = collate(rollout.samples, 0)["action_mask"]
        name = f"step_{estimator}_zero{stage}{'_packed' if packed else ''}{'_checkpointing' if checkpointing else ''}"
        results[name + ("_on_policy" if on_policy else "")] = {
            "grads": max(float((g1[k] - g0[k]).abs().max()) / max(1e-12, float(g0[k].abs().max())) for k in g0),
            "largest_grad": max(float(g.abs().max()) for g in g0.values()),
            "old_logprobs": float(((old1 - old0) * counted).abs().max()),
            "old_logprobs_reused": float(res.metrics["policy/old_logprobs_reused"]),
        }


def _read_grads(engine, seen: dict, prefix: str) -> None:
    """Record ``engine``'s gradients as DeepSpeed holds them before each optimizer step, in ``seen``."""
    from deepspeed.utils import safe_get_full_grad

    step = engine.step

    def read_then_step() -> None:
        # Unsplit, the trainer calls step() after every micro-batch (DeepSpeed's own accumulation
        # counter); the gradient is whole only at the boundary (ZeRO-3 shows partial sums before).
        if engine.is_gradient_accumulation_boundary():
            for name, p in engine.module.named_parameters():
                g = safe_get_full_grad(p)
                seen[prefix + name] = seen.get(prefix + name, 0) + (g.detach().clone() if g is not None else 0)
        step()

    engine.step = read_then_step


def worker(model_dir: str) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed("gloo")
    results: dict = {}
    if dist.get_world_size() == 2:
        _logprob_cases(model_dir, results)
        _step_cases(model_dir, results)
    else:  # 4 ranks: two groups of 2 (data parallel across them) against 4 data-parallel ranks unsplit
        _step_cases(model_dir, results, STEP_CASES[2:3])

    for rank in range(dist.get_world_size()):  # one line at a time: the ranks share the launcher's stdout
        if rank == dist.get_rank():
            print("RESULT " + json.dumps(results), flush=True)
        dist.barrier()


def _launch(model_dir, ranks: int) -> list[dict]:
    """Each rank's results of ``worker`` on ``ranks`` gloo ranks, all checked to fp32 tolerance."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__]
    proc = subprocess.run(cmd + [str(model_dir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln[len("RESULT ") :] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == ranks, (
        f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    out = [json.loads(line) for line in lines]
    for results in out:
        for name, r in results.items():
            assert r["largest_grad"] > 0, (name, r)
            assert r["grads"] < 1e-5, (name, r)
            for key in ("logprobs", "entropy", "loss", "old_logprobs", "values"):
                if key in r:
                    assert r[key] < 1e-5, (name, key, r)
    return out


@pytest.mark.slow
def test_the_split_over_two_gloo_ranks_gives_the_unsplit_loss_and_gradients(tiny_model_dir):
    for results in _launch(tiny_model_dir, 2):
        assert len(results) == 13, results
        assert results["step_group_norm_zero2_packed_on_policy"]["old_logprobs_reused"] == 1.0, results


@pytest.mark.slow
def test_two_groups_of_two_ranks_give_the_step_of_four_data_parallel_ranks(tiny_model_dir):
    """SP 2 x DP 2: each group its own samples, the old log-probs and values gathered across groups
    (a GAE step, packed: policy and critic gradients), against the same step on 4 DP ranks (~50 s)."""
    for results in _launch(tiny_model_dir, 4):
        assert list(results) == ["step_gae_zero2_packed"], results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    worker(sys.argv[1])
