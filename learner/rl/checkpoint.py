"""RL checkpoints: what ``learner.train_ppo --load_checkpoint`` needs to go on as if the run never stopped.

Layout of ``--ckpt_path`` (default ``SAVE_PATH/checkpoints``)::

    step_00000012/          a complete checkpoint: it exists only once everything in it is written
        state.json          run state (step, episode, policy version, KL coefficient, driver and
                            schedule state) and the config fields a resume must match; written last
        policy/ds/          DeepSpeed: weights, optimizer, LR scheduler (one shard per rank)
        critic/ds/          the same for the critic (--advantage_estimator gae)
        rng/rank_<r>.pt     torch (CPU, CUDA), python and numpy RNG states and the trainer's
                            mini-batch shuffling generator, per rank
        hf/                 the policy in HF format (--save_hf_ckpt; with --disable_ds_ckpt the only
                            weights: no policy/ds, critic/ds, and --load_checkpoint refuses it)
    .step_00000014.partial  a save in progress, or one killed half-way: never loaded; the next
                            save removes it

Atomic: every rank writes into the ``.partial`` directory (a shared filesystem, as DeepSpeed's
own checkpoints assume), rank 0 writes ``state.json`` last and renames the directory into place
(``common.atomic_dir.commit_dir``), and only then removes checkpoints beyond ``--max_ckpt_num``
(the best-evaluated one stays too, ``--best_metric_key``: ``learner.runtime.checkpoint_policy``).
A kill -9 at any point leaves the previous checkpoint as it was and the newest complete one is
what ``latest`` finds.

Prompts in flight. A checkpoint is taken after a step's weight push, on every rank together. In
the lockstep schedule nothing is in flight then: step s's prompts are ``PromptStream.batch(s)``
and its dynamic-filtering refills ``PromptStream.refills(s)``, both functions of s alone, so the
step is the stream position and a resumed run draws from step k+1 exactly what the uninterrupted
run drew. The async schedule (off-policy, generation running ahead of training) has prompts
handed out for steps after k when step k is saved, and groups scored and waiting. Its
``state_dict()`` (``schedules/async_.py``; the schedule's and the driver's dicts land in
``state.json`` under "schedule" and "driver", JSON-able values only) records them by their
position in the prompt stream (``PromptStream.at``): the next position to draw, the positions
drawn but neither trained nor dropped, and the feed's run-total counters. A resumed run issues
those prompts again first, to be generated anew by the resumed weights (prompts in flight cannot
be recovered anyway, and keeping the ready groups' samples would put tokens and log-probs beside
every checkpoint for groups worth at most K + 1 steps), then draws from the next position: no
prompt is skipped or trained twice (``learner.controller.feed.OffPolicyFeed.restore``). A
checkpoint without that state (made by lockstep) resumes async at ``batch(k+1)``, as lockstep
would.
The controller's prompt ids restart at 0 in a new process; nothing here depends on them.

How this differs from OpenRLHF's: there the DeepSpeed ``client_state`` carries the data loader
position and a crash during a save can leave a half-written newest tag that ``latest`` points at.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.atomic_dir import commit_dir
from learner.rl.config import PPOConfig
from learner.rl.evaluation import scores_in
from learner.runtime.checkpoint_policy import DEEPSPEED_STATES, not_resumable, retained

log = logging.getLogger("learner")

FORMAT = 1
STATE_FILE = "state.json"
DS_TAG = "ds"  # one tag per DeepSpeed directory: the step is in the directory name
_STEP_DIR = re.compile(r"^step_(\d+)$")

# Flags a resume must share with the run that saved: the DeepSpeed shards, the prompt order
# and the meaning of "step k" depend on them. Anything else (learning rate, logging, timeouts)
# may change across a restart.
MATCH_FIELDS = (
    "pretrain",
    "prompt_data",
    "seed",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "train_batch_size",
    "micro_train_batch_size",
    "advantage_estimator",
    "zero_stage",
)


class CheckpointMismatch(ValueError):
    """The checkpoint was made by a run with other settings; the message names each field."""


def ckpt_dir(cfg: PPOConfig) -> Path:
    return Path(cfg.ckpt_path or Path(cfg.save_path) / "checkpoints")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``root`` as (step, path), oldest first."""
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / STATE_FILE).is_file():
            out.append((int(m.group(1)), d))
    return sorted(out)


def latest(root: Path) -> Path | None:
    found = complete(root)
    return found[-1][1] if found else None


def match_fields(cfg: PPOConfig, *, world_size: int, n_prompts: int) -> dict[str, Any]:
    fields = {name: getattr(cfg, name) for name in MATCH_FIELDS}
    fields["world_size"] = world_size  # ZeRO shards are per rank
    fields["n_prompts"] = n_prompts  # same data file, same filtering of bad rows
    return fields


def check_match(saved: dict[str, Any], current: dict[str, Any], where: Path) -> None:
    """Raises CheckpointMismatch naming every field whose value differs."""
    diffs = [
        f"{k}: checkpoint {saved[k]!r}, this run {current.get(k)!r}"
        for k in sorted(saved)
        if k in current and saved[k] != current[k]
    ]
    if diffs:
        raise CheckpointMismatch(
            f"cannot resume from {where}: it was made with other settings ({'; '.join(diffs)}). "
            "Resume with the same flags, or point --ckpt_path elsewhere to start afresh"
        )


def check_resumable(cfg: PPOConfig, *, world_size: int, n_prompts: int) -> Path | None:
    """With --load_checkpoint: the checkpoint a resume will load (None: none, a fresh start),
    checked against this run's settings before anything slow is built. Raises CheckpointMismatch."""
    path = latest(ckpt_dir(cfg)) if cfg.load_checkpoint else None
    if path is not None:
        state = read_state(path)
        _check_loadable(state, path)
        check_match(state.get("match", {}), match_fields(cfg, world_size=world_size, n_prompts=n_prompts), path)
    return path


def _check_loadable(state: dict[str, Any], path: Path) -> None:
    why = not_resumable(state)
    if why:
        raise CheckpointMismatch(f"cannot resume from {path}: {why}")


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# --------------------------------------------------------------------------- metrics


def trim_metrics(path: Path, step: int) -> int:
    """Drops records after ``step`` from a JSON-lines metrics file (the killed run's steps that
    the resumed run does again), atomically; returns how many were dropped."""
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            rec_step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            dropped += 1  # a line cut by the kill
            continue
        if rec_step > step:
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".trim")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return dropped


# --------------------------------------------------------------------------- save / load


@dataclass
class Resumed:
    step: int
    path: Path
    state: dict[str, Any]


class Checkpointer:
    """Saves and loads RL checkpoints; ``save``/``resume`` run on every learner rank together.

    ``trainer`` is the PolicyTrainer (its engine, optional critic, KL controller and shuffling
    generator are saved); ``driver`` is rank 0's Driver (None elsewhere) and ``schedule`` the
    running schedule: their ``state_dict()`` is saved when they have one.
    """

    def __init__(
        self,
        cfg: PPOConfig,
        trainer: Any,
        *,
        rank: int,
        world_size: int,
        n_prompts: int,
        steps_per_episode: int,
        tokenizer: Any = None,
        driver: Any = None,
        schedule: Any = None,
    ) -> None:
        if cfg.max_ckpt_num < 1:
            raise ValueError(f"--max_ckpt_num must be >= 1, got {cfg.max_ckpt_num}")
        self.cfg, self.trainer = cfg, trainer
        self.rank, self.world_size = rank, world_size
        self.steps_per_episode = steps_per_episode
        self.tokenizer, self.driver, self.schedule = tokenizer, driver, schedule
        self.root = ckpt_dir(cfg)
        self.match = match_fields(cfg, world_size=world_size, n_prompts=n_prompts)

    def _engines(self) -> dict[str, Any]:
        engines = {"policy": self.trainer.engine}
        if getattr(self.trainer, "critic", None) is not None:
            engines["critic"] = self.trainer.critic.engine
        return engines

    def _run_state(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = {
            "format": FORMAT,
            "step": step,
            "episode": (step - 1) // self.steps_per_episode + 1 if step else 0,
            "policy_version": step,  # lockstep pushes version s after step s; the schedule may say otherwise
            "kl_ctl": self.trainer.kl_ctl.state_dict(),
            "trainer_steps_done": int(getattr(self.trainer, "steps_done", 0)),
            "match": self.match,
            DEEPSPEED_STATES: not self.cfg.disable_ds_ckpt,
        }
        for key, obj in (("driver", self.driver), ("schedule", self.schedule)):
            if obj is not None and hasattr(obj, "state_dict"):
                state[key] = obj.state_dict()
        return state

    def save(self, step: int) -> Path:
        """Writes checkpoint ``step`` atomically; call on every rank after the step's push."""
        from learner.runtime import engine as E

        final = step_dir(self.root, step)
        partial = self.root / f".{final.name}.partial"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a save of this step killed earlier
            partial.mkdir()
        E.barrier()
        if not self.cfg.disable_ds_ckpt:  # else the HF policy below is the checkpoint's only weights
            for name, eng in self._engines().items():
                E.save_checkpoint(eng, partial / name, tag=DS_TAG)  # collective
        rng = {**rng_state(), "trainer_generator": self.trainer.generator.get_state()}
        (partial / "rng").mkdir(exist_ok=True)
        torch.save(rng, partial / "rng" / f"rank_{self.rank}.pt")
        if self.cfg.save_hf_ckpt:
            E.save_hf(self.trainer.engine, self.tokenizer, partial / "hf")  # collective
        E.barrier()  # every rank's shards are down before the directory becomes a checkpoint
        if self.rank == 0:
            state = self._run_state(step)
            _write_json_durably(partial / STATE_FILE, state)
            commit_dir(partial, final)
            self._prune(keep=final, scores=scores_in(state))
            log.info("saved checkpoint %s", final)
        E.barrier()
        return final

    def _prune(self, keep: Path, scores: dict[int, float]) -> None:
        """Keeps the newest --max_ckpt_num and the best-evaluated checkpoint (``retained``;
        ``scores``: the evaluations' by step, as the new checkpoint's state holds them)."""
        found = complete(self.root)
        kept = retained([s for s, _ in found], max_num=self.cfg.max_ckpt_num, scores=scores)
        for step, old in found:
            if step not in kept and old != keep:
                shutil.rmtree(old, ignore_errors=True)
                log.info("removed old checkpoint %s (--max_ckpt_num %d)", old, self.cfg.max_ckpt_num)
        older = sorted(kept)[: -self.cfg.max_ckpt_num]
        if older:
            log.info(
                "kept checkpoint step %d besides the newest: best evaluation so far (%.4g)", older[0], scores[older[0]]
            )
        for d in self.root.glob(".step_*.partial"):  # left by a save killed half-way
            shutil.rmtree(d, ignore_errors=True)

    def resume(self) -> Resumed | None:
        """Loads the newest complete checkpoint into every part; None if there is none.
        Raises CheckpointMismatch (on every rank, before any collective) on other settings."""
        from learner.runtime import engine as E

        path = latest(self.root)
        if path is None:
            if self.rank == 0:
                log.info("--load_checkpoint: no checkpoint in %s; starting afresh", self.root)
            return None
        state = read_state(path)
        _check_loadable(state, path)
        check_match(state.get("match", {}), self.match, path)
        for name, eng in self._engines().items():
            E.load_checkpoint(eng, path / name, tag=DS_TAG)
        rng = torch.load(path / "rng" / f"rank_{self.rank}.pt", weights_only=False)
        self.trainer.generator.set_state(rng.pop("trainer_generator"))
        set_rng_state(rng)
        self.trainer.kl_ctl.load_state_dict(state["kl_ctl"])
        if hasattr(self.trainer, "steps_done"):
            self.trainer.steps_done = int(state.get("trainer_steps_done", 0))
        for key, obj in (("driver", self.driver), ("schedule", self.schedule)):
            if obj is not None and key in state and hasattr(obj, "load_state_dict"):
                obj.load_state_dict(state[key])
        if self.driver is not None and getattr(self.driver, "sink", None) is not None:
            dropped = trim_metrics(Path(self.driver.sink.path), int(state["step"]))
            if hasattr(self.driver.sink, "resume_after"):
                self.driver.sink.resume_after(int(state["step"]))
            if dropped:
                log.info("metrics: dropped %d record(s) after step %d (they are done again)", dropped, state["step"])
        if self.rank == 0:
            log.info(
                "resumed from %s: step %d (episode %d), policy version %d, KL coefficient %.4g",
                path,
                state["step"],
                state["episode"],
                state["policy_version"],
                state["kl_ctl"]["value"],
            )
        return Resumed(int(state["step"]), path, state)


def read_state(path: Path) -> dict[str, Any]:
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("format") != FORMAT:
        raise CheckpointMismatch(f"{path}: checkpoint format {state.get('format')}, this learner reads {FORMAT}")
    return state


def _write_json_durably(path: Path, obj: Any) -> None:
    # fsync: the rename that follows must never publish a state.json still in a page cache
    # that a host crash loses (a kill -9 alone would not need it).
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
