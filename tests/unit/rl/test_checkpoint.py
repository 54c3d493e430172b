"""RL checkpoints (learner/rl/checkpoint.py) on a stand-in engine: what a checkpoint holds and
gives back, atomic saves (a save killed -9 half-way leaves the previous checkpoint loadable),
pruning to --max_ckpt_num only after a save completes, and a resume with other settings refused
naming each field. DeepSpeed's own save/load is covered by the supervised trainers' tests and
the e2e resume test; here the engine writes one file, so these run in a second."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from learner.algorithms.kl import AdaptiveKLController, FixedKLController
from learner.controller.types import PromptItem
from learner.rl import checkpoint as C
from learner.rl.config import PPOConfig
from learner.rl.prompts import PromptStream

ROOT = Path(__file__).resolve().parents[3]


class FakeEngine:
    """Stands in for a DeepSpeed engine: one tensor, saved as ``save_dir/tag/w.pt``."""

    def __init__(self, value: float = 0.0, slow_s: float = 0.0) -> None:
        self.w = torch.full((3,), value)
        self.slow_s = slow_s

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict) -> None:
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        if self.slow_s:
            (d / "half").write_text("half")
            time.sleep(self.slow_s)  # where a test kills the process
        torch.save(self.w, d / "w.pt")

    def load_checkpoint(self, load_dir: str, tag: str, **kw):
        self.w = torch.load(Path(load_dir) / tag / "w.pt")
        return load_dir, {}


class FakeTrainer:
    def __init__(self, cfg: PPOConfig, value: float = 0.0, slow_s: float = 0.0) -> None:
        self.engine = FakeEngine(value, slow_s)
        self.critic = None
        self.kl_ctl = AdaptiveKLController(0.1, 6.0, 1000) if cfg.kl_target else FixedKLController(0.1)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.steps_done = 0


def items(n: int = 8) -> list[PromptItem]:
    return [PromptItem(tokens=[i, i + 1]) for i in range(n)]


class FakeDriver:
    def __init__(self, prompts: PromptStream, metrics: Path) -> None:
        self.prompts = prompts
        self.sink = type("Sink", (), {"path": metrics})()
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
    return PPOConfig(**{**args, **kw})


def checkpointer(cfg: PPOConfig, trainer: FakeTrainer, tmp_path: Path, n_prompts: int = 8) -> C.Checkpointer:
    driver = FakeDriver(PromptStream(items(n_prompts), cfg.rollout_batch_size), tmp_path / "metrics.jsonl")
    return C.Checkpointer(cfg, trainer, rank=0, world_size=1, n_prompts=n_prompts, steps_per_episode=4, driver=driver)


def test_a_checkpoint_gives_back_weights_rng_kl_and_the_step(tmp_path):
    cfg = cfg_for(tmp_path, kl_target=6.0)
    trainer = FakeTrainer(cfg, value=1.5)
    trainer.kl_ctl.update(12.0, 100)  # drifted away from its initial 0.1
    torch.randperm(5, generator=trainer.generator)  # the shuffler has moved on
    ck = checkpointer(cfg, trainer, tmp_path)
    random.seed(7)
    torch.manual_seed(7)
    path = ck.save(6)
    assert path == C.ckpt_dir(cfg) / "step_00000006" and C.latest(C.ckpt_dir(cfg)) == path
    expected = (torch.rand(2), random.random(), torch.randperm(5, generator=trainer.generator), trainer.kl_ctl.value)

    fresh = FakeTrainer(cfg)  # a new process: initial weights, RNGs and KL
    torch.manual_seed(0)
    resumed = checkpointer(cfg, fresh, tmp_path).resume()
    assert resumed.step == 6 and resumed.state["episode"] == 2 and resumed.state["policy_version"] == 6
    assert torch.equal(fresh.engine.w, torch.full((3,), 1.5))
    assert fresh.kl_ctl.value == pytest.approx(expected[3]) and fresh.kl_ctl.value != 0.1
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    assert torch.equal(torch.randperm(5, generator=fresh.generator), expected[2])


def test_no_checkpoint_is_a_fresh_start(tmp_path):
    cfg = cfg_for(tmp_path, load_checkpoint=True)
    assert checkpointer(cfg, FakeTrainer(cfg), tmp_path).resume() is None
    assert C.check_resumable(cfg, world_size=1, n_prompts=8) is None


def test_old_checkpoints_are_pruned_to_max_ckpt_num_after_the_new_one_is_complete(tmp_path):
    cfg = cfg_for(tmp_path, max_ckpt_num=2)
    ck = checkpointer(cfg, FakeTrainer(cfg), tmp_path)
    for step in (2, 4, 6):
        ck.save(step)
    root = C.ckpt_dir(cfg)
    assert [s for s, _ in C.complete(root)] == [4, 6]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]


def test_the_best_evaluated_checkpoint_is_kept_besides_the_newest(tmp_path):
    """--max_ckpt_num 2, evaluations at every save: step 4 scores best and outlives the rule of the
    newest two until step 10 does better; step 8's equal score does not replace it."""
    cfg = cfg_for(tmp_path, max_ckpt_num=2)
    ck = checkpointer(cfg, FakeTrainer(cfg), tmp_path)
    kept = []
    for step, score in ((2, 0.1), (4, 0.5), (6, 0.2), (8, 0.5), (10, 0.7), (12, 0.3)):
        ck.driver.eval_scores[step] = score  # the evaluation at a step comes before its save
        ck.save(step)
        kept.append([s for s, _ in C.complete(C.ckpt_dir(cfg))])
    assert kept == [[2], [2, 4], [4, 6], [4, 6, 8], [8, 10], [10, 12]]


def test_a_checkpoint_without_deepspeed_states_is_saved_and_refused_for_resume(tmp_path, monkeypatch):
    """--disable_ds_ckpt: the HF policy and the run state, no DeepSpeed directories; resuming is
    refused, before anything is built and again at the load, saying why and what to do."""
    from learner.runtime import engine as E

    monkeypatch.setattr(E, "save_hf", lambda engine, tok, path, **kw: Path(path).mkdir(parents=True) or None)
    cfg = cfg_for(tmp_path, disable_ds_ckpt=True, save_hf_ckpt=True)
    path = checkpointer(cfg, FakeTrainer(cfg), tmp_path).save(2)
    assert sorted(p.name for p in path.iterdir()) == ["hf", "rng", "state.json"]
    assert C.read_state(path)["deepspeed_states"] is False
    again = cfg_for(tmp_path, load_checkpoint=True)
    with pytest.raises(C.CheckpointMismatch, match=r"step_00000002: it was saved with --disable_ds_ckpt.*--pretrain"):
        C.check_resumable(again, world_size=1, n_prompts=8)
    with pytest.raises(C.CheckpointMismatch, match="--disable_ds_ckpt"):
        checkpointer(again, FakeTrainer(again), tmp_path).resume()
    # A checkpoint from before the flag existed has DeepSpeed states: no key means resumable.
    state = C.read_state(path)
    del state["deepspeed_states"]
    (path / "state.json").write_text(json.dumps(state))
    assert C.check_resumable(again, world_size=1, n_prompts=8) == path


def test_metrics_after_the_resumed_step_are_dropped(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 3, 4)) + '{"step": 5, "x"')
    assert C.trim_metrics(m, 2) == 3  # steps 3, 4 and the line the kill cut
    assert [json.loads(line)["step"] for line in m.read_text().splitlines()] == [0, 1, 2]


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
        C.check_resumable(other, world_size=1, n_prompts=8)
    assert named in str(e.value)
    with pytest.raises(C.CheckpointMismatch, match="world_size: checkpoint 1, this run 2"):
        C.check_resumable(cfg_for(tmp_path, load_checkpoint=True), world_size=2, n_prompts=8)
    with pytest.raises(C.CheckpointMismatch, match="n_prompts: checkpoint 8, this run 9"):
        C.check_resumable(cfg_for(tmp_path, load_checkpoint=True), world_size=1, n_prompts=9)


def test_other_prompts_of_the_same_count_are_refused_by_the_stream(tmp_path):
    cfg = cfg_for(tmp_path)
    checkpointer(cfg, FakeTrainer(cfg), tmp_path).save(2)
    ck = checkpointer(cfg, FakeTrainer(cfg), tmp_path)
    ck.driver.prompts = PromptStream(list(reversed(items())), 2)  # --seed kept, data reordered
    with pytest.raises(ValueError, match="prompt stream differs.*fingerprint"):
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
    assert C.latest(root) == root / "step_00000002"
    cfg = cfg_for(tmp_path, load_checkpoint=True)
    trainer = FakeTrainer(cfg)
    resumed = checkpointer(cfg, trainer, tmp_path).resume()
    assert resumed.step == 2 and torch.equal(trainer.engine.w, torch.full((3,), 2.0))
    checkpointer(cfg, FakeTrainer(cfg, value=4.0), tmp_path).save(4)  # the next save clears the debris
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
