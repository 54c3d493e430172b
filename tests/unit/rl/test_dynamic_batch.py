"""--train.dynamic_batch_enable: micro-batches by a token budget give the loss and gradients of
fixed micro-batches.

* the flags parse with OpenRLHF's names and meanings, the no-grad budget defaults to the training
  one, and launch.local passes it on to the reward services;
* the optimizer window of a planned number of micro-batches owns DeepSpeed's boundary and steps once;
* a PolicyTrainer step on the tiny model (a gradient-recording ``GradEngine`` in DeepSpeed's place,
  as tests/unit/rl/test_packing.py does) gives, with a token budget, the gradients, the summed loss
  and the old log-probs of the same batch in fixed micro-batches: every ``--loss_agg_mode``, packed
  and padded, and for the critic (gae); also when another rank's count forces this one to run more
  micro-batches than its samples need (cut groups and stand-ins of weight 0);
* slow: two gloo ranks on DeepSpeed ZeRO-3, whose ranks need different numbers of micro-batches:
  the counts are evened (no hang) and the reduced gradient equals the fixed micro-batches' one.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.procs import run_worker
from helpers.trainer_fakes import GradEngine, small_ppo_config
from learner.controller.types import Rollout, ScoredSample
from learner.rl import micro_batches
from learner.rl.critic import Critic, load_critic
from learner.rl.experience import collate
from learner.rl.policy_trainer import PolicyTrainer
from learner.runtime.accumulation import OptimizerStep

# --------------------------------------------------------------------------- flags


def test_the_flags_parse_with_openrlhfs_names_and_the_no_grad_budget_follows_the_training_one():
    from common.config import parse
    from learner.rl.config import PPOConfig

    base = ["--pretrain", "m", "--prompt_data", "p", "--advantage_estimator", "reinforce"]
    cfg = parse(PPOConfig, [*base, "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096"])
    assert cfg.train.dynamic_batch_enable and cfg.train.max_tokens_per_gpu == 4096
    assert cfg.rollout.max_tokens_per_gpu == 4096  # OpenRLHF: None -> the training budget
    flat = parse(PPOConfig, [*base, "--use_dynamic_batch", "--rollout_max_tokens_per_gpu", "8192"])
    assert flat.train.dynamic_batch_enable and flat.rollout.max_tokens_per_gpu == 8192
    assert flat.train.max_tokens_per_gpu == 16192  # OpenRLHF's default
    assert not any("dynamic_batch" in n for n in cfg.notices + flat.notices)  # built: not inert
    idle = parse(PPOConfig, [*base, "--train.max_tokens_per_gpu", "4096"])
    assert any("act only with --train.dynamic_batch_enable" in n for n in idle.notices)
    with pytest.raises(SystemExit):
        parse(PPOConfig, [*base, "--use_dynamic_batch", "--train.max_tokens_per_gpu", "0"])


def test_launch_local_passes_the_no_grad_budget_to_the_reward_services(tmp_path):
    from launch.local import LocalConfig, build_roles

    def reward_cmd(learner_args: str) -> list[str]:
        cfg = LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=f"--prompt_data p {learner_args}")
        return {r.name: r for r in build_roles(cfg)}["reward-0"].cmd

    cmd = reward_cmd("--train.dynamic_batch_enable --rollout.max_tokens_per_gpu 2048")
    assert cmd[cmd.index("--max_tokens_per_gpu") + 1] == "2048" and "--ref_pretrain" in cmd
    cmd = reward_cmd("--use_dynamic_batch --train_max_tokens_per_gpu 1000")
    assert cmd[cmd.index("--max_tokens_per_gpu") + 1] == "1000"
    assert "--max_tokens_per_gpu" not in reward_cmd("--rollout.max_tokens_per_gpu 2048")  # not enabled


# --------------------------------------------------------------------------- the optimizer window


class BoundaryEngine:
    """DeepSpeed's surface that ``OptimizerStep`` uses, recording the calls in order."""

    def __init__(self, accum: int) -> None:
        self.accum, self.calls = accum, []

    def gradient_accumulation_steps(self) -> int:
        return self.accum

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.calls.append(f"boundary={is_boundary}")

    def backward(self, loss) -> None:
        self.calls.append(f"backward {loss}")

    def step(self) -> None:
        self.calls.append("step")


def test_a_planned_window_owns_the_boundary_and_steps_once_whatever_the_engines_accumulation():
    eng = BoundaryEngine(accum=2)  # DeepSpeed's fixed count: 2; this step has 3 micro-batches
    with OptimizerStep(eng, coalesce=False, micro_batches=3) as step:
        for loss in (1, 2, 3):
            step.backward(loss)
    assert eng.calls == [
        *("boundary=False", "backward 1", "boundary=False", "backward 2", "boundary=True", "backward 3"),
        "boundary=True",
        "step",
    ]
    eng = BoundaryEngine(accum=4)
    with OptimizerStep(eng, coalesce=False, micro_batches=1) as step:
        step.backward(1)
    assert eng.calls == ["boundary=True", "backward 1", "boundary=True", "step"]
    with pytest.raises(RuntimeError, match="2 micro-batches where 3 were planned"):
        with OptimizerStep(BoundaryEngine(accum=2), coalesce=False, micro_batches=3) as step:
            step.backward(1)
            step.backward(2)
    with pytest.raises(RuntimeError, match="more than the 1 planned micro-batches"):
        with OptimizerStep(BoundaryEngine(accum=2), coalesce=False, micro_batches=1) as step:
            step.backward(1)
            step.backward(2)


# --------------------------------------------------------------------------- a trainer step


def _rollout(ref: bool = False) -> Rollout:
    """8 samples of very uneven lengths: prompts of 1-5 tokens, responses of 1 to 14."""
    samples = []
    for i in range(8):
        prompt = [5 + i % 3, 6, 7, 11, 13][: 1 + (i * 3) % 5]
        n = [1, 14, 2, 11, 1, 3, 13, 2][i]
        response = torch.tensor([(8 + i + 7 * k) % 700 for k in range(n)], dtype=torch.int32)
        lp = -0.1 * torch.arange(1, n + 1, dtype=torch.float32)  # "vLLM's" log-probs
        samples.append(ScoredSample(i // 2, i % 2, prompt, response, lp, lp - 0.05 if ref else None, float(i % 3)))
    return Rollout(samples, group_size=2)


class LossEngine(GradEngine):
    """GradEngine that also records every loss it is asked to backward."""

    def __init__(self, model: torch.nn.Module, accum: int) -> None:
        super().__init__(model, accum)
        self.losses: list[float] = []

    def backward(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss.detach()))
        super().backward(loss)


def _model(model_dir) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")


def _step(model_dir, rollout: Rollout, on_policy: bool, **kw):
    cfg = small_ppo_config(model_dir, **{"generate_max_len": 14, **kw})
    accum = cfg.train.batch_size // cfg.train.micro_batch_size
    critic = None
    if cfg.needs_critic:
        torch.manual_seed(0)
        critic = Critic(
            LossEngine(load_critic(str(model_dir)), accum),
            pad_id=0,
            device=torch.device("cpu"),
            micro_rollout_batch_size=cfg.rollout.micro_batch_size,
            value_clip=cfg.critic.value_clip,
            max_tokens=cfg.rollout.max_tokens_per_gpu if cfg.train.dynamic_batch_enable else 0,
        )
    engine = LossEngine(_model(model_dir), accum)
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=torch.device("cpu"), critic=critic)
    result = trainer.step(rollout, on_policy=on_policy)
    return engine, critic, result


def _assert_same_grads(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, float(b.abs().max())))
    assert any(g.abs().max() > 0 for g in got)


def _assert_same_step(got, want, rollout: Rollout) -> None:
    (g_engine, g_critic, g_result), (w_engine, w_critic, w_result) = got, want
    _assert_same_grads(g_engine.grads(), w_engine.grads())
    # The loss of the batch: the sum of the shares each micro-batch backwarded (the same scale
    # in both, the engine's accumulation steps), whatever the grouping.
    assert sum(g_engine.losses) == pytest.approx(sum(w_engine.losses), rel=1e-5, abs=1e-6)
    mask = collate(rollout.samples, 0)["action_mask"]
    torch.testing.assert_close(g_result.old_logprobs[mask], w_result.old_logprobs[mask], rtol=0, atol=1e-5)
    if w_critic is not None:
        _assert_same_grads(g_critic.engine.grads(), w_critic.engine.grads())
        assert sum(g_critic.engine.losses) == pytest.approx(sum(w_critic.engine.losses), rel=1e-5)


DYNAMIC = dict(use_dynamic_batch=True, train_max_tokens_per_gpu=16, rollout_max_tokens_per_gpu=30)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_a_token_budget_step_gives_the_fixed_micro_batches_loss_and_gradients(tiny_model_dir, mode, packed):
    # Off-policy, KL loss and entropy in the loss: the old-log-probs pass runs (by the rollout
    # budget) and every term of the loss is aggregated; 2 epochs: two optimizer steps.
    kw = dict(
        loss_agg_mode=mode,
        packing_samples=packed,
        use_kl_loss=True,
        init_kl_coef=0.1,
        entropy_loss_coef=0.01,
        is_correction="tis",
        max_epochs=2,
        train_batch_size=4,
        micro_train_batch_size=2,
        rollout_batch_size=4,
    )
    rollout = _rollout(ref=True)
    fixed = _step(tiny_model_dir, rollout, False, **kw)
    budget = _step(tiny_model_dir, rollout, False, **kw, **DYNAMIC)
    # the budget changed the grouping: fixed, 2 micro-batches in each of the 4 optimizer steps
    assert len(fixed[0].losses) == 8 and len(budget[0].losses) != 8, budget[0].losses
    _assert_same_step(budget, fixed, rollout)
    assert "policy/micro_batches" not in fixed[2].metrics


def test_the_critics_passes_by_a_token_budget_give_the_same_values_and_gradients(tiny_model_dir):
    kw = dict(advantage_estimator="gae", n_samples_per_prompt=1, rollout_batch_size=8, lambd=0.95, packing_samples=True)
    rollout = _rollout(ref=True)
    fixed = _step(tiny_model_dir, rollout, True, **kw)
    budget = _step(tiny_model_dir, rollout, True, **kw, **DYNAMIC)
    _assert_same_step(budget, fixed, rollout)
    v_fixed, v_budget = fixed[1].values(rollout, packed=True), budget[1].values(rollout, packed=True)
    mask = collate(rollout.samples, 0)["action_mask"]
    torch.testing.assert_close(v_budget[mask], v_fixed[mask], rtol=0, atol=1e-5)


def test_a_rank_that_must_run_more_micro_batches_than_it_needs_keeps_the_gradients(tiny_model_dir, monkeypatch):
    """Another rank's count is the MAX: this one cuts its groups up to it and, past one sample
    each, runs stand-ins (a forward and backward of weight 0) so ZeRO's collectives would meet."""
    rollout = _rollout()
    fixed = _step(tiny_model_dir, rollout, True)
    monkeypatch.setattr(micro_batches, "_max_over_ranks", lambda n, device: 10)  # 8 samples, 10 micro-batches
    budget = _step(tiny_model_dir, rollout, True, **DYNAMIC)
    assert budget[2].metrics["policy/micro_batches"] == 10
    assert budget[0].forwards["grad"] == 10 and len(budget[0].losses) == 10
    assert budget[0].losses[-2:] == [0.0, 0.0]  # the two stand-ins (groups are heaviest first, empty last)
    _assert_same_step(budget, fixed, rollout)


# --------------------------------------------------------------------------- ZeRO-2/3, two ranks


@pytest.mark.slow
def test_zero_on_two_ranks_evens_the_counts_and_keeps_the_gradient(tiny_model_dir):
    """Two gloo ranks on DeepSpeed ZeRO-3 (each forward gathers, each backward reduce-scatters: a
    rank running one micro-batch more than the other would hang) and ZeRO-2, coalesced (one
    reduction per step) and not (a reduction after every backward, GPUs' default), the boundary
    set by the window either way. The ranks' own counts differ (one
    holds more long samples); after the all-reduce both run the MAX, and the gradient the
    optimizer receives equals that of fixed micro-batches to fp32 rounding (~1e-7 relative; a
    lost or doubled micro-batch moves it by its share, ~0.1)."""
    r = run_worker(__file__, [str(tiny_model_dir)], nproc=2, timeout=600)
    assert r["own_counts_differ"], r  # the case that would hang without evening the counts
    for run in ("2-on", "2-off", "3-auto"):
        s = r[run]
        assert s["grad_rel_diff"] <= 1e-5, r
        assert s["grad_norms"]["budget"] == pytest.approx(s["grad_norms"]["fixed"], rel=1e-5), r
        assert s["loss_sum"]["budget"] == pytest.approx(s["loss_sum"]["fixed"], rel=1e-5, abs=1e-7), r
        assert s["optimizer_steps"] == {"fixed": 1, "budget": 1}, r
    assert r["2-on"]["coalesced"] and not r["2-off"]["coalesced"], r


def _worker(model_dir: str) -> None:
    from learner.runtime import engine as E

    info = E.init_distributed()
    samples = []
    for i in range(8):  # 4 prompts x 2; long and short responses
        prompt = [3 + (i * 7 + k) % 600 for k in range(2 + i % 3)]
        n = 24 if i in (0, 2, 3, 6) else 2
        response = torch.tensor([(11 * i + 5 * k) % 700 + 3 for k in range(n)], dtype=torch.int32)
        samples.append(ScoredSample(i // 2, i % 2, prompt, response, -0.1 * torch.ones(n), None, float(i % 3)))
    rollout = Rollout(samples, 2)
    seen: list[tuple[int, int]] = []
    real_max = micro_batches._max_over_ranks

    def recording_max(n, device):
        out = real_max(n, device)
        seen.append((n, out))
        return out

    micro_batches._max_over_ranks = recording_max
    result: dict = {}
    # ZeRO-2 first: a ZeRO-3 load leaves transformers' DeepSpeed config set for this process's later loads
    for stage, coalesce in ((2, "on"), (2, "off"), (3, "auto")):
        res: dict = {"grad_norms": {}, "optimizer_steps": {}, "loss_sum": {}}
        first: dict = {}
        for mode in ("fixed", "budget"):
            extra = dict(use_dynamic_batch=True, train_max_tokens_per_gpu=40) if mode == "budget" else {}
            cfg = small_ppo_config(
                model_dir,
                micro_train_batch_size=2,
                generate_max_len=24,
                zero_stage=stage,
                coalesce_grad_reduction=coalesce,
                **extra,
            )
            torch.manual_seed(0)
            engine = E.make_engine(
                E.load_causal_lm(model_dir, zero_stage=stage),
                zero_stage=stage,
                bf16=False,
                train_batch_size=8,
                micro_train_batch_size=2,
                learning_rate=1e-2,
                num_training_steps=10,
                lr_scheduler="constant_with_warmup",
                lr_warmup_ratio=0.0,
            )
            inner = engine.optimizer.optimizer  # torch AdamW over this rank's fp32 partitions
            real_step = inner.step

            def recording_step(*a, _mode=mode, _inner=inner, _real=real_step, _first=first, **kw):
                ps = [p for g in _inner.param_groups for p in g["params"]]
                _first[_mode] = [p.grad.detach().clone() for p in ps]  # reduced and clipped: what Adam sees
                return _real(*a, **kw)

            inner.step = recording_step
            losses: list[float] = []
            real_backward = engine.backward

            def recording_backward(loss, *a, _losses=losses, _real=real_backward, **kw):
                _losses.append(float(loss.detach()))
                return _real(loss, *a, **kw)

            engine.backward = recording_backward
            trainer = PolicyTrainer(engine, cfg, pad_id=0, device=info.device)
            res["coalesced"] = trainer.coalesce
            trainer.step(rollout, on_policy=True)
            res["grad_norms"][mode] = float(engine.get_global_grad_norm())
            res["optimizer_steps"][mode] = engine.global_steps
            total = torch.tensor([sum(losses)], dtype=torch.float64)
            torch.distributed.all_reduce(total)
            res["loss_sum"][mode] = float(total)
            del trainer, engine
        pairs = list(zip(first["budget"], first["fixed"], strict=True))
        num = sum(float(((a - b).double() ** 2).sum()) for a, b in pairs)
        den = sum(float((b.double() ** 2).sum()) for _, b in pairs)
        sums = torch.tensor([num, den], dtype=torch.float64)
        torch.distributed.all_reduce(sums)  # the whole gradient: each rank holds its partition
        res["grad_rel_diff"] = float(sums[0] / sums[1]) ** 0.5
        result[f"{stage}-{coalesce}"] = res
    micro_batches._max_over_ranks = real_max
    differ = torch.tensor([int(any(n != m for n, m in seen))], dtype=torch.long)
    torch.distributed.all_reduce(differ)
    result["own_counts_differ"] = bool(differ.item())
    result["counts_rank0"] = seen
    E.barrier()
    if E.is_rank0():
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
