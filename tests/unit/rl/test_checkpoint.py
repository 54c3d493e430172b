"""RL checkpoints (learner/rl/checkpoint.py over learner/runtime/checkpoint.py) on a stand-in
engine: what a checkpoint holds and gives back, atomic saves (a save killed -9 half-way leaves
the previous checkpoint loadable), pruning to --max_ckpt_num only after a save completes, a
resume with other settings refused naming each field, and damaged checkpoints (truncated
state.json, truncated model states, a missing file) skipped for the newest good one, or refused
when named. DeepSpeed's own save/load is covered by the supervised trainers' tests and the e2e
resume test; here the engine writes one file, so these run in a second."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from common.config import build
from learner.algorithms.kl import AdaptiveKLController, FixedKLController
from learner.controller.types import PromptItem
from learner.rl import checkpoint as C
from learner.rl.config import PPOConfig
from learner.rl.prompts import PromptStream
from learner.runtime import checkpoint as R
from learner.runtime import checkpoint_manifest as manifest
from learner.runtime.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[3]


class FakeEngine:
    """Stands in for a DeepSpeed engine: one tensor, saved as ``save_dir/tag/mp_rank_00_model_states.pt``."""

    def __init__(self, value: float = 0.0, slow_s: float = 0.0) -> None:
        self.w = torch.full((3,), value)
        self.slow_s = slow_s

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict) -> None:
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        if self.slow_s:
            (d / "half").write_text("half")
            time.sleep(self.slow_s)  # where a test kills the process
        torch.save(self.w, d / MODEL_STATES)

    def load_checkpoint(self, load_dir: str, tag: str, **kw):
        self.w = torch.load(Path(load_dir) / tag / MODEL_STATES)
        return load_dir, {}


MODEL_STATES = "mp_rank_00_model_states.pt"


class FakeTrainer:
    def __init__(self, cfg: PPOConfig, value: float = 0.0, slow_s: float = 0.0) -> None:
        self.engine = FakeEngine(value, slow_s)
        self.critic = None
        self.kl_ctl = AdaptiveKLController(0.1, 6.0, 1000) if cfg.algo.kl.target else FixedKLController(0.1)
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        self.steps_done = 0
        self.ema = None  # --train.enable_ema: a learner.runtime.ema.EMA

    def state_dict(self):  # as PolicyTrainer's
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state):
        self.steps_done = int(state["steps_done"])


def items(n: int = 8) -> list[PromptItem]:
    return [PromptItem(tokens=[i, i + 1]) for i in range(n)]


class FakeDriver:
    def __init__(self, prompts: PromptStream, metrics: Path) -> None:
        self.prompts = prompts
        self.sink = MetricsWriter(metrics)
        self.eval_scores: dict[int, float] = {}  # what Driver.history holds: each evaluation's score by step

    def state_dict(self):
        scores = {str(k): v for k, v in self.eval_scores.items()}
        return {"prompts": self.prompts.state_dict(), "eval": {"key": "eval/accuracy", "scores": scores}}

    def load_state_dict(self, state):
        self.prompts.load_state_dict(state["prompts"])


def cfg_for(tmp_path: Path, **kw) -> PPOConfig:
    args = dict(
        pretrain="tiny",
        prompt_data="p.jsonl",
        save_path=str(tmp_path / "out"),
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        train_batch_size=4,
        micro_train_batch_size=2,
        max_ckpt_num=2,
    )
    return build(PPOConfig, **{**args, **kw})


class FakeSchedule:
    def __init__(self) -> None:
        self.state: dict = {"feed": {"next_position": 0}}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def fake_driver(cfg: PPOConfig, tmp_path: Path, n_prompts: int = 8) -> FakeDriver:
    return FakeDriver(PromptStream(items(n_prompts), cfg.rollout.batch_size), tmp_path / "metrics.jsonl")


def checkpointer(
    cfg: PPOConfig, trainer: FakeTrainer, tmp_path: Path, n_prompts: int = 8, driver: FakeDriver | None = None
) -> R.Checkpointer:
    driver = driver or fake_driver(cfg, tmp_path, n_prompts)
    return C.rl_checkpointer(cfg, trainer, n_prompts=n_prompts, schedule=FakeSchedule(), driver=driver)


def test_a_checkpoint_gives_back_weights_rng_kl_and_the_step(tmp_path):
    cfg = cfg_for(tmp_path, kl_target=6.0)
    trainer = FakeTrainer(cfg, value=1.5)
    trainer.kl_ctl.update(12.0, 100)  # drifted away from its initial 0.1
    torch.randperm(5, generator=trainer.generator)  # the shuffler has moved on
    trainer.steps_done = 5
    ck = checkpointer(cfg, trainer, tmp_path)
    random.seed(7)
    torch.manual_seed(7)
    path = ck.save(6)
    assert path == C.ckpt_dir(cfg) / "step_00000006" and R.find(C.ckpt_dir(cfg)) == path
    expected = (torch.rand(2), random.random(), torch.randperm(5, generator=trainer.generator), trainer.kl_ctl.value)

    fresh = FakeTrainer(cfg)  # a new process: initial weights, RNGs and KL
    torch.manual_seed(0)
    resumed = checkpointer(cfg, fresh, tmp_path).resume()
    assert resumed.step == 6 and resumed.state["schedule"] == {"feed": {"next_position": 0}}
    assert fresh.steps_done == 5
    assert torch.equal(fresh.engine.w, torch.full((3,), 1.5))
    assert fresh.kl_ctl.value == pytest.approx(expected[3]) and fresh.kl_ctl.value != 0.1
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    assert torch.equal(torch.randperm(5, generator=fresh.generator), expected[2])


def test_no_checkpoint_is_a_fresh_start(tmp_path):
    cfg = cfg_for(tmp_path, load_checkpoint=True)
    assert checkpointer(cfg, FakeTrainer(cfg), tmp_path).resume() is None
    assert C.check_resumable(cfg, n_prompts=8) is None


def test_old_checkpoints_are_pruned_to_max_ckpt_num_after_the_new_one_is_complete(tmp_path):
    cfg = cfg_for(tmp_path, max_ckpt_num=2)
    ck = checkpointer(cfg, FakeTrainer(cfg), tmp_path)
    for step in (2, 4, 6):
        ck.save(step)
    root = C.ckpt_dir(cfg)
    assert [s for s, _ in R.checkpoints(root)] == [4, 6]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]


def test_metrics_written_after_the_checkpoint_are_dropped_at_resume(tmp_path):
    cfg = cfg_for(tmp_path, load_checkpoint=True)
    driver = fake_driver(cfg, tmp_path)
    ck, sink = checkpointer(cfg, FakeTrainer(cfg), tmp_path, driver=driver), driver.sink
    for s in (0, 1, 2):
        sink.write(s, {"x": s})
    ck.save(2)
    for s in (3, 4):
        sink.write(s, {"x": s})  # the killed run's steps after the checkpoint
    with sink.path.open("a") as fh:
        fh.write('{"step": 5, "x"')  # and the line the kill cut
    checkpointer(cfg, FakeTrainer(cfg), tmp_path).resume()
    assert [json.loads(line)["step"] for line in sink.path.read_text().splitlines()] == [0, 1, 2]


def test_the_best_evaluated_checkpoint_is_kept_besides_the_newest(tmp_path):
    """--max_ckpt_num 2, evaluations at every save: step 4 scores best and outlives the rule of the
    newest two until step 10 does better; step 8's equal score does not replace it."""
    cfg = cfg_for(tmp_path, max_ckpt_num=2)
    driver = fake_driver(cfg, tmp_path)
    ck = checkpointer(cfg, FakeTrainer(cfg), tmp_path, driver=driver)
    kept = []
    for step, score in ((2, 0.1), (4, 0.5), (6, 0.2), (8, 0.5), (10, 0.7), (12, 0.3)):
        driver.eval_scores[step] = score  # the evaluation at a step comes before its save
        ck.save(step)
        kept.append([s for s, _ in R.checkpoints(C.ckpt_dir(cfg))])
    assert kept == [[2], [2, 4], [4, 6], [4, 6, 8], [8, 10], [10, 12]]


def test_a_checkpoint_without_deepspeed_states_is_saved_and_refused_for_resume(tmp_path, monkeypatch):
    """--disable_ds_ckpt: the HF policy and the run state, no DeepSpeed directories; resuming is
    refused, before anything is built and again at the load, saying why and what to do."""
    from learner.runtime import engine as E

    monkeypatch.setattr(E, "save_hf", lambda engine, tok, path, **kw: Path(path).mkdir(parents=True) or None)
    cfg = cfg_for(tmp_path, disable_ds_ckpt=True, save_hf_ckpt=True)
    path = checkpointer(cfg, FakeTrainer(cfg), tmp_path).save(2)
    assert sorted(p.name for p in path.iterdir()) == ["hf", "manifest.json", "rng", "state.json"]
    assert R.read_state(path)["weights"]["deepspeed_states"] is False
    for again in (cfg_for(tmp_path, load_checkpoint=True), cfg_for(tmp_path, load_checkpoint=True, **{
        "disable_ds_ckpt": True, "save_hf_ckpt": True})):  # fmt: skip
        with pytest.raises(
            C.CheckpointMismatch, match=r"step_00000002: it was saved with --disable_ds_ckpt.*--pretrain"
        ):
            C.check_resumable(again, n_prompts=8)
        with pytest.raises(C.CheckpointMismatch, match="--disable_ds_ckpt"):
            checkpointer(again, FakeTrainer(again), tmp_path).resume()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rollout_batch_size": 4}, "rollout_batch_size: checkpoint 2, this run 4"),
        ({"pretrain": "other"}, "pretrain: checkpoint 'tiny', this run 'other'"),
        ({"n_samples_per_prompt": 4, "train_batch_size": 8}, "n_samples_per_prompt: checkpoint 2, this run 4"),
    ],
)
def test_a_resume_with_other_settings_fails_naming_the_field(tmp_path, change, named):
    cfg = cfg_for(tmp_path)
    checkpointer(cfg, FakeTrainer(cfg), tmp_path).save(2)
    other = cfg_for(tmp_path, load_checkpoint=True, **change)
    with pytest.raises(C.CheckpointMismatch, match="step_00000002") as e:
        C.check_resumable(other, n_prompts=8)
    assert named in str(e.value)
    with pytest.raises(C.CheckpointMismatch, match="n_prompts: checkpoint 8, this run 9"):
        C.check_resumable(cfg_for(tmp_path, load_checkpoint=True), n_prompts=9)
    # the number of ranks (ZeRO shards, RNG files are per rank): a state.json saved by 2 ranks
    ckpt = C.ckpt_dir(cfg) / "step_00000002"
    state = json.loads((ckpt / "state.json").read_text())
    state["match"]["world_size"] = 2
    (ckpt / "state.json").write_text(json.dumps(state))
    manifest.write_for(ckpt)
    with pytest.raises(C.CheckpointMismatch, match="world_size: checkpoint 2, this run 1"):
        C.check_resumable(cfg_for(tmp_path, load_checkpoint=True), n_prompts=8)


def test_other_prompts_of_the_same_count_are_refused_by_the_stream(tmp_path):
    cfg = cfg_for(tmp_path)
    checkpointer(cfg, FakeTrainer(cfg), tmp_path).save(2)
    driver = fake_driver(cfg, tmp_path)
    driver.prompts = PromptStream(list(reversed(items())), 2)  # --seed kept, data reordered
    ck = checkpointer(cfg, FakeTrainer(cfg), tmp_path, driver=driver)
    with pytest.raises(C.CheckpointMismatch, match="driver: the checkpoint's prompt stream differs.*fingerprint"):
        ck.resume()


KILLED_SAVE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_checkpoint import FakeTrainer, cfg_for, checkpointer
    tmp = Path({tmp!r})
    cfg = cfg_for(tmp)
    checkpointer(cfg, FakeTrainer(cfg, value=2.0), tmp).save(2)
    checkpointer(cfg, FakeTrainer(cfg, value=4.0, slow_s=60), tmp).save(4)  # killed in here
    """
)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    """A real process saves step 2, then is killed -9 in the middle of saving step 4."""
    script = KILLED_SAVE.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    root = C.ckpt_dir(cfg_for(tmp_path))
    partial = root / ".step_00000004.partial"
    deadline = time.monotonic() + 60
    while not (partial / "policy" / "ds" / "half").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the save never got half-way"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert R.find(root) == root / "step_00000002"
    cfg = cfg_for(tmp_path, load_checkpoint=True)
    trainer = FakeTrainer(cfg)
    resumed = checkpointer(cfg, trainer, tmp_path).resume()
    assert resumed.step == 2 and torch.equal(trainer.engine.w, torch.full((3,), 2.0))
    checkpointer(cfg, FakeTrainer(cfg, value=4.0), tmp_path).save(4)  # the next save clears the debris
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]


# --------------------------------------------------------------------------- damaged checkpoints

POLICY_STATES = f"policy/ds/{MODEL_STATES}"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGES = {
    "truncated state.json": (lambda d: _truncate(d / "state.json"), r"state\.json has \d+ bytes, the manifest says"),
    "truncated model states": (
        lambda d: _truncate(d / POLICY_STATES),
        rf"{POLICY_STATES} has \d+ bytes, the manifest says \d+",
    ),
    "a missing file": (lambda d: (d / "rng" / "rank_0.pt").unlink(), r"rng/rank_0\.pt is missing"),
    "overwritten model states": (
        lambda d: (d / POLICY_STATES).write_bytes(b"\0" * (d / POLICY_STATES).stat().st_size),
        rf"{POLICY_STATES} fails its checksum \(crc32 [0-9a-f]{{8}}, the manifest says [0-9a-f]{{8}}\)",
    ),
    "no manifest": (lambda d: (d / "manifest.json").unlink(), r"no manifest\.json"),
}


def _two_checkpoints(tmp_path: Path) -> tuple[PPOConfig, Path]:
    cfg = cfg_for(tmp_path, load_checkpoint=True, max_ckpt_num=3)
    checkpointer(cfg, FakeTrainer(cfg, value=2.0), tmp_path).save(2)
    checkpointer(cfg, FakeTrainer(cfg, value=4.0), tmp_path).save(4)
    return cfg, C.ckpt_dir(cfg)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_good_one(tmp_path, caplog, damage):
    """Each damage of issue 24: the run resumes from the older checkpoint, with a warning naming
    the damaged one and the file at fault; the pre-check before the models load agrees."""
    cfg, root = _two_checkpoints(tmp_path)
    hurt, named = DAMAGES[damage]
    hurt(root / "step_00000004")
    if damage != "overwritten model states":  # sizes alone find it: the pre-check skips it too
        assert C.check_resumable(cfg, n_prompts=8) == root / "step_00000002"
    trainer = FakeTrainer(cfg)
    with caplog.at_level("WARNING", logger="rayless.checkpoint"):
        resumed = checkpointer(cfg, trainer, tmp_path).resume()
    assert resumed.step == 2 and torch.equal(trainer.engine.w, torch.full((3,), 2.0))
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"skipping checkpoint {root / 'step_00000004'}: it is damaged (" in warning
    assert re.search(named, warning), warning


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_an_explicitly_named_damaged_checkpoint_is_refused_in_one_line_naming_the_file(tmp_path, damage):
    cfg, root = _two_checkpoints(tmp_path)
    hurt, named = DAMAGES[damage]
    hurt(root / "step_00000004")
    cfg = cfg_for(tmp_path, load_checkpoint=True, ckpt_path=str(root / "step_00000004"))
    with pytest.raises(R.DamagedCheckpoint) as e:
        checkpointer(cfg, FakeTrainer(cfg), tmp_path).resume()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {root / 'step_00000004'} is damaged: ")
    assert re.search(named, msg), msg


def test_an_explicitly_named_good_checkpoint_is_resumed_and_later_saves_go_beside_it(tmp_path):
    cfg, root = _two_checkpoints(tmp_path)
    cfg = cfg_for(tmp_path, load_checkpoint=True, max_ckpt_num=3, ckpt_path=str(root / "step_00000002"))
    assert C.check_resumable(cfg, n_prompts=8) == root / "step_00000002"
    trainer = FakeTrainer(cfg)
    ck = checkpointer(cfg, trainer, tmp_path)
    assert ck.resume().step == 2 and torch.equal(trainer.engine.w, torch.full((3,), 2.0))
    ck.save(3)
    assert [s for s, _ in R.checkpoints(root)] == [2, 3, 4]


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    cfg, root = _two_checkpoints(tmp_path)
    _truncate(root / "step_00000004" / POLICY_STATES)
    (root / "step_00000002" / "rng" / "rank_0.pt").unlink()
    with pytest.raises(R.DamagedCheckpoint, match=f"every checkpoint in {root} is damaged.*step_00000004: policy"):
        checkpointer(cfg, FakeTrainer(cfg), tmp_path).resume()


# --------------------------------------------------------------------------- --train.enable_ema


class Policy(torch.nn.Module):
    """The policy's trained weights as the moving average reads them (the stand-in engine keeps
    its own tensor: the engine restores the weights, the average is a part of its own)."""

    def __init__(self, w: tuple[float, float] = (1.0, -2.0)) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w))


def _averaging_trainer(cfg: PPOConfig, policy: Policy) -> FakeTrainer:
    from learner.runtime.ema import EMA

    trainer = FakeTrainer(cfg)
    trainer.ema = EMA(policy, cfg.train.ema_beta)
    return trainer


def _train(trainer: FakeTrainer, policy: Policy, weights: list[list[float]]) -> None:
    for w in weights:  # an optimizer step moved the weights; the average follows
        with torch.no_grad():
            policy.w.copy_(torch.tensor(w))
        trainer.ema.update()


STEPS = [[0.1, 1 / 3], [0.7, -0.3], [1 / 7, 2.5], [-0.9, 0.01]]  # steps 1-4: no binary fractions


def test_the_policys_moving_average_is_restored_bit_exactly_and_goes_on_as_uninterrupted(tmp_path):
    cfg = cfg_for(tmp_path, enable_ema=True, ema_beta=0.9, load_checkpoint=True)
    policy = Policy()
    trainer = _averaging_trainer(cfg, policy)
    ck = checkpointer(cfg, trainer, tmp_path)
    _train(trainer, policy, STEPS[:2])
    path = ck.save(2)
    at_save = trainer.ema.shards["w"].clone()
    _train(trainer, policy, STEPS[2:])  # the uninterrupted run
    assert (path / "ema" / "ds" / "rank_0.pt").is_file()
    assert "ema/ds/rank_0.pt" in manifest.read(path)  # damage to it is found like any other file's
    assert C.check_resumable(cfg, n_prompts=8) == path

    resumed_policy = Policy((5.0, 5.0))  # a new process: the average starts elsewhere, then loads
    resumed = _averaging_trainer(cfg, resumed_policy)
    assert checkpointer(cfg, resumed, tmp_path).resume().step == 2
    assert torch.equal(resumed.ema.shards["w"], at_save) and resumed.ema.updates == 2
    _train(resumed, resumed_policy, STEPS[2:])
    assert torch.equal(resumed.ema.shards["w"], trainer.ema.shards["w"]) and resumed.ema.updates == 4


def test_averaging_is_refused_on_a_checkpoint_without_an_average_and_may_be_dropped(tmp_path):
    plain = cfg_for(tmp_path)
    checkpointer(plain, FakeTrainer(plain), tmp_path).save(2)
    averaging = cfg_for(tmp_path, enable_ema=True, load_checkpoint=True)
    with pytest.raises(C.CheckpointMismatch, match=r"step_00000002 with --train.enable_ema: it holds no moving"):
        C.check_resumable(averaging, n_prompts=8)
    with pytest.raises(R.CheckpointError, match="ema: the ema engine could not load it.*without --train.enable_ema"):
        checkpointer(averaging, _averaging_trainer(averaging, Policy()), tmp_path).resume()
    # the other way round: a run that stops averaging resumes, leaving the average behind
    checkpointer(averaging, _averaging_trainer(averaging, Policy()), tmp_path).save(4)
    again = cfg_for(tmp_path, load_checkpoint=True)
    assert checkpointer(again, FakeTrainer(again), tmp_path).resume().step == 4


def test_with_save_hf_ckpt_a_checkpoint_holds_the_average_as_hf_and_the_trained_policy_beside(tmp_path, monkeypatch):
    """As OpenRLHF's `{tag}_hf`: the average is the checkpoint's HF model; rayless keeps the
    trained one beside it (hf_trained/). --disable_ds_ckpt leaves the average's shards out too."""
    from learner.runtime import engine as E

    written = {}

    def save_hf(engine, tok, path, **kw):  # what each directory got: the module's w at the time
        Path(path).mkdir(parents=True)
        written[Path(path).name] = policy.w.detach().clone()

    monkeypatch.setattr(E, "save_hf", save_hf)
    cfg = cfg_for(tmp_path, enable_ema=True, ema_beta=0.5, save_hf_ckpt=True, disable_ds_ckpt=True)
    policy = Policy()
    trainer = _averaging_trainer(cfg, policy)
    _train(trainer, policy, [[3.0, 0.0]])  # average (2, -1)
    path = checkpointer(cfg, trainer, tmp_path).save(2)
    assert sorted(p.name for p in path.iterdir()) == ["hf", "hf_trained", "manifest.json", "rng", "state.json"]
    assert torch.equal(written["hf"], torch.tensor([2.0, -1.0]))
    assert torch.equal(written["hf_trained"], torch.tensor([3.0, 0.0]))
