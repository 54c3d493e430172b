"""The colocated schedule's order of turns, against stand-ins: engines wake, generate, sleep;
DeepSpeed reloads, trains, offloads; the engines' weights wake; the push. A world of one (the
broadcasts pass values through). Also what each half does where it cannot act: said once."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from common import protocol as P
from common.config import build
from common.transport import PeerUnavailable, RemoteError
from learner.controller.types import Rollout, ScoredSample
from learner.rl.config import PPOConfig
from learner.rl.driver import StepBatch
from learner.rl.policy_trainer import StepResult
from learner.rl.schedules import Decision, RunParts, make_schedule, schedule_name
from learner.rl.schedules.colocated import ColocatedTurns, check_colocated_push, make_turns
from learner.rl.schedules.turns import SLEEP_LEVEL, CannotAct, EngineMemory, LearnerStates

G = 2


def _rollout(n_groups: int, g: int, version: int) -> Rollout:
    return Rollout(
        [
            ScoredSample(i, j, [1], torch.tensor([2, 3]), torch.zeros(2), None, float(j), policy_version=version)
            for i in range(n_groups)
            for j in range(g)
        ],
        g,
    )


class Recorder:
    """Trainer, weight push, driver, DeepSpeed engine and rollout client in one: every call
    lands in ``calls``."""

    def __init__(self, batches=(), *, answer=None) -> None:
        self.batches = list(batches)
        self.calls: list[tuple] = []
        self.answer = answer or (lambda server, msg: P.Ack())
        self.optimizer = SimpleNamespace(offload_states=True)
        self.peers = {
            "rollout-0": SimpleNamespace(
                capabilities=P.RolloutCapabilities(platform="cuda", gpu_memory_utilization=0.5)
            )
        }

    # trainer / weight push / driver
    def step(self, rollout, *, on_policy=False, version=None):
        self.calls.append(("train", len(rollout)))
        return StepResult({}, torch.zeros(len(rollout), 2))

    def push(self, version):
        self.calls.append(("push", version))

    def gather(self, step):
        self.calls.append(("gather", step))
        return StepBatch(self.batches.pop(0))

    def skipped(self, step, batch):
        self.calls.append(("skipped", step))

    def report(self, *a, **kw):
        self.calls.append(("report",))

    def evaluate(self, step, collect=None):
        self.calls.append(("evaluate", step))

    # DeepSpeed engine
    def zero_optimization_stage(self):
        return 2

    def offload_states(self, **kw):
        self.calls.append(("offload",))

    def reload_states(self, **kw):
        self.calls.append(("reload",))

    # rollout client
    def servers(self, ready_only=True):
        return list(self.peers)

    def peer(self, name):
        return self.peers.get(name)

    def request(self, server, msg):
        tag = type(msg).__name__ + (f"({msg.level})" if isinstance(msg, P.Sleep) else "")
        if isinstance(msg, P.WakeUp):
            tag += f"({','.join(msg.tags) if msg.tags else 'all'})"
        self.calls.append((tag, server))
        reply = self.answer(server, msg)

        def result(timeout):
            if isinstance(reply, P.Error):
                raise RemoteError(server, reply)
            if isinstance(reply, BaseException):
                raise reply
            return reply

        return SimpleNamespace(result=result)


def _cfg(**kw) -> PPOConfig:
    base = dict(
        pretrain="m",
        prompt_data="p",
        rollout_batch_size=4,
        n_samples_per_prompt=G,
        train_batch_size=4,
        micro_train_batch_size=2,
        advantage_estimator="group_norm",
        colocate_all_models=True,
        vllm_enable_sleep=True,
        deepspeed_enable_sleep=True,
        weight_sync_backend="gloo",
    )
    return build(PPOConfig, **{**base, **kw})


def _schedule(rec: Recorder, *, device="cuda", notes=None, **kw):
    cfg = _cfg(**kw)
    turns = make_turns(cfg, [rec], torch.device(device), rec, notes)
    parts = RunParts(cfg, rec, rec, rec, torch.device("cpu"), total_steps=5, turns=turns)
    return make_schedule(parts)


def test_the_flag_selects_the_colocated_schedule_and_async_is_refused():
    assert schedule_name(_cfg().train) == "colocated"
    assert schedule_name(_cfg(colocate_all_models=False, vllm_enable_sleep=False).train) == "lockstep"
    with pytest.raises(ValueError, match="--colocate_all_models and --async_train contradict"):
        _cfg(async_train=True, vllm_enable_sleep=False)


def test_sleep_flags_without_colocation_are_turned_off_as_in_openrlhf(caplog):
    with caplog.at_level(logging.WARNING, logger="learner"):
        cfg = _cfg(colocate_all_models=False)
    assert not cfg.vllm.enable_sleep and not cfg.ds.enable_sleep
    assert "--vllm_enable_sleep acts only with --colocate_all_models: turned off" in cfg.notices
    assert not caplog.records  # the run says it once logging is set up (learner.rl.run.init_process)


def test_a_step_takes_turns_in_order():
    rec = Recorder([_rollout(2, G, version=2)])
    sched = _schedule(rec)
    sched.start(0)
    assert rec.calls == [("offload",), ("push", 0)]  # engines awake at start: nothing to wake
    rec.calls.clear()
    assert sched.step(3) is Decision.TRAIN
    assert rec.calls == [
        ("gather", 3),
        (f"Sleep({SLEEP_LEVEL})", "rollout-0"),
        ("reload",),
        ("train", 4),
        ("offload",),
        ("WakeUp(weights)", "rollout-0"),
        ("push", 3),
        ("report",),
    ]
    rec.calls.clear()
    rec.batches.append(_rollout(2, G, version=3))
    sched.step(4)
    assert rec.calls[:2] == [("WakeUp(all)", "rollout-0"), ("gather", 4)]  # the KV cache wakes to generate
    rec.calls.clear()
    sched.finish()  # the engines end the run awake
    assert rec.calls == [("WakeUp(all)", "rollout-0")]


def test_an_evaluation_between_steps_wakes_the_engines_which_stay_awake_for_the_next_step():
    """After a step the KV cache sleeps (only the weights woke for the push): the evaluation
    wakes it to generate, and leaves it awake, since the next step generates first anyway
    (sleeping at level 2 would drop the weights just pushed)."""
    rec = Recorder([_rollout(2, G, version=2), _rollout(2, G, version=3)])
    sched = _schedule(rec)
    sched.start(2)
    sched.step(3)
    rec.calls.clear()
    sched.evaluate(3)
    assert rec.calls == [("WakeUp(all)", "rollout-0"), ("evaluate", 3)]
    rec.calls.clear()
    sched.step(4)
    assert rec.calls[0] == ("gather", 4)  # nothing left asleep to wake


def test_a_skipped_step_leaves_the_engines_awake_and_the_states_parked():
    rec = Recorder([_rollout(1, G, version=0)])  # 2 samples < a train batch of 4
    sched = _schedule(rec)
    sched.start(0)
    rec.calls.clear()
    assert sched.step(1) is Decision.SKIP
    assert rec.calls == [("gather", 1), ("skipped", 1)]


def test_a_checkpoint_save_sees_the_states_resident():
    rec = Recorder()
    sched = _schedule(rec)
    sched.start(0)
    rec.calls.clear()
    with sched.states_resident():
        rec.calls.append(("save",))
    assert rec.calls == [("reload",), ("save",), ("offload",)]


def test_on_cpu_each_flag_says_once_that_it_cannot_act_and_the_step_is_lockstep(caplog):
    why = "sleep/wake not supported: vLLM has no sleep mode on CPU (there is no device memory to free)"
    rec = Recorder(
        [_rollout(2, G, version=0), _rollout(2, G, version=1)],
        answer=lambda server, msg: P.Error(code="not_supported", message=why),
    )
    rec.peers["rollout-0"].capabilities = P.RolloutCapabilities(platform="cpu", gpu_memory_utilization=0.85)
    with caplog.at_level(logging.WARNING, logger="learner"):
        sched = _schedule(rec, device="cpu", vllm_gpu_memory_utilization=0.5)
        sched.start(0)
        sched.step(1)
        sched.step(2)
    said = [r.getMessage() for r in caplog.records if "cannot act here" in r.getMessage()]
    assert said == [
        "--deepspeed_enable_sleep cannot act here: the learner trains on CPU: its optimizer states already live "
        "in host memory, so offload_states would move them where they are and free nothing for the engines",
        "--vllm_gpu_memory_utilization cannot act here: rollout-0 runs vLLM on CPU: no device memory is shared "
        "with the learner there (vLLM reads the share as one of host memory, checked at engine start, and sizes "
        "its KV cache from VLLM_CPU_KVCACHE_SPACE)",
        f"--vllm_enable_sleep cannot act here: rollout-0: {why}",
    ]
    # Asked once; a server that cannot sleep is not asked again. The rest is lockstep's order.
    assert [c for c in rec.calls if c[0] not in ("gather", "train", "push", "report")] == [("Sleep(2)", "rollout-0")]
    assert [c[0] for c in rec.calls] == ["push", "gather", "Sleep(2)", "train", "push", "report"] + [
        "gather",
        "train",
        "push",
        "report",
    ]


def test_a_server_that_cannot_wake_to_generate_stops_the_step():
    rec = Recorder([_rollout(2, G, version=0)])
    sched = _schedule(rec)
    sched.start(0)
    sched.step(1)  # asleep now (KV cache)
    rec.answer = lambda server, msg: P.Error(code="internal", message="cuMem failed")
    with pytest.raises(RuntimeError, match="could not wake up to generate"):
        sched.step(2)


def test_a_server_gone_while_asleep_is_not_an_error():
    rec = Recorder([_rollout(2, G, version=0), _rollout(2, G, version=1)])
    sched = _schedule(rec)
    sched.start(0)
    sched.step(1)
    rec.answer = lambda server, msg: PeerUnavailable(f"{server} is gone")
    sched.step(2)  # the pool reaps it; its prompts are re-issued elsewhere


def test_memory_share_differing_from_the_learners_is_named(caplog):
    rec = Recorder()
    mem = EngineMemory(rec, sleep=True, gpu_memory_utilization=0.4, notes=CannotAct())
    with caplog.at_level(logging.WARNING, logger="learner"):
        mem.check_servers()
        mem.check_servers()  # once per server
    assert caplog.text.count("rollout-0 was started with --gpu_memory_utilization 0.5") == 1


def test_zero3_offload_without_fused_adam_is_refused_and_stage_0_cannot_act():
    rec = Recorder()
    rec.zero_optimization_stage = lambda: 3
    rec.optimizer = SimpleNamespace(offload_states=True, optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1))
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match="--zero_stage 3.*FusedAdam"):
        LearnerStates([rec], torch.device("cuda"), enabled=True, adam_offload=False, notes=CannotAct())
    notes = CannotAct()
    rec.optimizer = torch.optim.SGD([torch.zeros(1)], lr=0.1)  # stage 0: no offload_states
    assert not LearnerStates([rec], torch.device("cuda"), enabled=True, adam_offload=False, notes=notes).active
    assert "ZeRO stage 0" in notes.said["deepspeed_enable_sleep"]


def test_nccl_push_is_refused_for_colocated_engines():
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        check_colocated_push(_cfg(weight_sync_backend="nccl"))
    check_colocated_push(_cfg())  # gloo: fine


def test_turns_without_a_rollout_client_on_other_ranks():
    turns = make_turns(_cfg(), [Recorder()], torch.device("cuda"), None)
    assert isinstance(turns, ColocatedTurns) and turns.engines is None and turns.learner.active
