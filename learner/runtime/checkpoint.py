"""The one checkpoint manager of every trainer: the RL run (``learner.rl.checkpoint`` registers
its parts) and SFT, RM, DPO (``learner.supervised.checkpoint``).

Layout of the checkpoint directory (``--ckpt_path``, default ``SAVE_PATH/checkpoints``)::

    step_00000012/          a checkpoint; it exists under this name only once complete
        <engine>/ds/        a DeepSpeed engine's shards (weights, optimizer, LR schedule), one
                            directory per registered engine (policy, critic; model)
        rng/rank_<r>.pt     per rank: torch (CPU, CUDA), python and numpy RNG states and the
                            registered generators (a trainer's mini-batch shuffler)
        <export>/           written into every checkpoint, never read back (hf/: --save_hf_ckpt)
        state.json          the step, the settings a resume must match ("match"), and under its
                            name each registered part's ``state_dict()`` (rank 0's)
        manifest.json       every file above with its size and CRC32, written last
                            (``learner.runtime.checkpoint_manifest``)
    .step_00000014.partial  a save under way, or one killed half-way: never loaded; the next
                            save removes it

Participants are registered by name, each with the interface it implements, so the manager
never guesses at an object's insides:

    ckpt = Checkpointer(location, max_keep=cfg.max_ckpt_num, match={"pretrain": ..., ...})
    ckpt.add_engine("policy", engine)            # ShardedEngine: saves its shards into a directory
    ckpt.add_state("kl_ctl", trainer.kl_ctl)     # Stateful: JSON-able state_dict / load_state_dict
    ckpt.add_generator("shuffle", generator)     # a torch.Generator, saved per rank with the RNGs
    ckpt.add_export("hf", lambda d: save_hf(engine, tokenizer, d))
    resumed = ckpt.resume()                      # None: nothing to resume, a fresh start
    ckpt.save(step)

``save``, ``resume`` and ``find`` are collectives: every rank calls them, in the same order.
A JSON part holds rank 0's state: it is saved from rank 0 and loaded on every rank that
registered it, so a part that only rank 0 has (the RL driver, the metrics file) is registered
there only.

Atomic: every rank writes into the ``.partial`` directory (the ranks share the filesystem, as
DeepSpeed's own checkpoints assume), rank 0 writes ``state.json`` and then the manifest, and
renames the directory into place (``common.atomic_dir.commit_dir``); only then are checkpoints
beyond ``max_keep`` removed, oldest step first. A kill -9 at any point leaves the previous
checkpoint as it was.

Resume: ``location`` is either the checkpoint directory (resume from the newest checkpoint in
it) or one checkpoint (``.../step_00000012``: resume from exactly that one; later saves go
beside it). Each candidate is verified against its manifest (sizes and checksums, the work
shared over the ranks): resuming from the newest skips a damaged one with a warning naming it
and the file at fault, and takes the newest good one; an explicitly named damaged one is
refused (``DamagedCheckpoint``: one line naming the file). Then the settings the checkpoint
was made with must equal this run's ``match`` (``CheckpointMismatch`` names each field that
differs; the number of ranks is always one), every part's state is loaded, and only when every
rank succeeded do the engines load (a rank that failed alone would leave the others waiting
in the engines' collectives).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from common.atomic_dir import commit_dir
from learner.runtime import checkpoint_manifest as manifest

log = logging.getLogger("rayless.checkpoint")

FORMAT = 2  # 1: RL checkpoints before manifests (refused: they have no manifest)
STATE_FILE = "state.json"
RNG_DIR = "rng"
DS_TAG = "ds"  # one tag per engine directory: the step is in the checkpoint's name
RESERVED = frozenset({"format", "step", "match"})  # state.json's own keys
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names it and the file, field or part at fault."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was made with other settings (or holds other parts); the message names each."""


class DamagedCheckpoint(CheckpointError):
    """A file of the checkpoint is missing, or differs from what its manifest says."""


@runtime_checkable
class Stateful(Protocol):
    """A part whose state is a JSON-able dict (KL controller, prompt stream, schedule, progress)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class ShardedEngine(Protocol):
    """An engine that writes its own shards into a directory, on every rank: DeepSpeed's, or the
    policy's moving average (``learner.runtime.ema``)."""

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> Any: ...

    def load_checkpoint(self, load_dir: str, tag: str, **kwargs: Any) -> Any: ...


@dataclass
class Resumed:
    step: int
    path: Path
    state: dict[str, Any]  # state.json


# --------------------------------------------------------------------------- where


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def locate(location: str | Path) -> tuple[Path, Path | None]:
    """``(root, explicit)``: the directory checkpoints are saved in, and the one checkpoint
    ``location`` names (None when it names the directory)."""
    path = Path(location)
    if _STEP_DIR.match(path.name):
        return path.parent, path
    return path, None


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The checkpoint directories in ``root`` (by name, damaged or not) as (step, path), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir():
            found.append((int(m.group(1)), d))
    return sorted(found)


# --------------------------------------------------------------------------- collectives


def _dist():
    import torch.distributed as dist

    return dist if dist.is_initialized() and dist.get_world_size() > 1 else None


def _rank_world() -> tuple[int, int]:
    d = _dist()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def _all_gather(obj: Any) -> list[Any]:
    d = _dist()
    if d is None:
        return [obj]
    out: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    d = _dist()
    if d is None:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    d = _dist()
    if d is not None:
        d.barrier()


def _agree(error: CheckpointError | None) -> None:
    """Raises on every rank when any rank failed (each its own error, or the first rank's)."""
    failed = [(r, str(e)) for r, e in enumerate(_all_gather(str(error) if error else None)) if e]
    if error is not None:
        raise error
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"rank {rank}: {msg}")


# --------------------------------------------------------------------------- verify and choose


def verify(path: Path, *, checksums: bool = True) -> str | None:
    """What is wrong with checkpoint ``path`` (None: it is complete), every rank checking its
    share of the files against the manifest; every rank returns the same answer."""
    rank, world = _rank_world()
    mine: list[str] = []
    try:
        files = manifest.read(path)
    except manifest.ManifestError as e:
        mine.append(str(e))
    else:
        if STATE_FILE not in files:
            mine.append(f"its manifest lists no {STATE_FILE}")
        sizes = {name: int(entry.get("size") or 0) for name, entry in files.items()}
        for name in manifest.shares(sizes, world)[rank]:
            bad = manifest.problem(path, name, files[name], checksum=checksums)
            if bad:
                mine.append(bad)
    problems = list(dict.fromkeys(p for ps in _all_gather(mine) for p in ps))
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return problems[0] + more


def find(location: str | Path, *, checksums: bool = True, warn: bool = True) -> Path | None:
    """The checkpoint a resume loads: the one ``location`` names, or the newest undamaged one in
    it (each damaged one skipped with a warning when ``warn``); None when there is none.
    Raises DamagedCheckpoint for a damaged named one, or when every checkpoint is damaged."""
    root, explicit = locate(location)
    if explicit is not None:
        if not _broadcast(explicit.is_dir()):
            raise CheckpointError(f"{explicit}: no such checkpoint")
        bad = verify(explicit, checksums=checksums)
        if bad:
            raise DamagedCheckpoint(f"checkpoint {explicit} is damaged: {bad}")
        return explicit
    found = _broadcast(checkpoints(root))  # one listing for every rank
    if not found:
        if _broadcast((root / "latest").is_file()):
            raise CheckpointError(
                f"{root} holds DeepSpeed checkpoints in the old layout ('latest' names "
                f"{(root / 'latest').read_text().strip()!r}), which this version does not resume; "
                "point --ckpt_path elsewhere to start afresh"
            )
        return None
    first_problem = ""
    for _, path in reversed(found):
        bad = verify(path, checksums=checksums)
        if bad is None:
            return path
        first_problem = first_problem or f"{path.name}: {bad}"
        if warn and _rank_world()[0] == 0:
            log.warning("skipping checkpoint %s: it is damaged (%s); trying the one before", path, bad)
    raise DamagedCheckpoint(
        f"every checkpoint in {root} is damaged (the newest, {first_problem}); "
        "move them aside, or point --ckpt_path elsewhere, to start afresh"
    )


def read_state(path: Path) -> dict[str, Any]:
    """``path``'s state.json (a checkpoint ``verify`` passed)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: {STATE_FILE} is unreadable ({e})") from None
    if state.get("format") != FORMAT:
        raise CheckpointMismatch(f"{path}: checkpoint format {state.get('format')}, this learner reads {FORMAT}")
    return state


def check_match(saved: Mapping[str, Any], current: Mapping[str, Any], where: Path) -> None:
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


def check_resumable(location: str | Path, match: Mapping[str, Any]) -> Path | None:
    """Before anything slow is built: the checkpoint a resume will load (None: a fresh start),
    verified by sizes (the checksums wait for ``Checkpointer.resume``, which reads the files
    anyway) and checked against this run's ``match`` (plus the number of ranks). Collective.
    Raises CheckpointError."""
    path = find(location, checksums=False, warn=False)
    if path is not None:
        check_match(read_state(path).get("match", {}), {**match, "world_size": _rank_world()[1]}, path)
    return path


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


# --------------------------------------------------------------------------- the manager


class Checkpointer:
    """Saves and resumes the registered parts (see the module docstring); ``save`` and ``resume``
    run on every rank together.

    Args:
        location: ``--ckpt_path`` resolved (``learner.runtime.checkpoint_config.checkpoint_location``).
        max_keep: ``--max_ckpt_num``.
        match: the settings a resume must share with the run that saved (JSON-able values);
            the number of ranks is added.
        checksums: CRC32 every file into the manifest and check it at resume (sizes always).
        retain: which checkpoint steps survive a save, given the complete ones' steps and the
            new one's state.json (default: the newest ``max_keep``); it must keep the newest.
    """

    def __init__(
        self,
        location: str | Path,
        *,
        max_keep: int = 3,
        match: Mapping[str, Any] | None = None,
        checksums: bool = True,
        retain: Callable[[list[int], Mapping[str, Any]], set[int]] | None = None,
    ) -> None:
        if max_keep < 1:
            raise ValueError(f"--max_ckpt_num must be >= 1, got {max_keep}")
        self.location = Path(location)
        self.root, _ = locate(location)
        self.max_keep = max_keep
        self.retain = retain or (lambda steps, state: set(sorted(steps)[-max_keep:]))
        self.checksums = checksums
        self.rank, self.world_size = _rank_world()
        self.match = {**(match or {}), "world_size": self.world_size}
        self._states: dict[str, Stateful] = {}
        self._engines: dict[str, ShardedEngine] = {}
        self._unsaved: set[str] = set()  # engines loaded at resume but not saved (--disable_ds_ckpt)
        self._generators: dict[str, torch.Generator] = {}
        self._exports: dict[str, Callable[[Path], None]] = {}

    # ---- registration
    def _name(self, name: str, *, directory: bool) -> str:
        taken = {*self._states, *self._engines, *self._generators, *self._exports}
        if name in taken or name in RESERVED or (directory and name in (RNG_DIR, STATE_FILE, manifest.MANIFEST)):
            raise ValueError(f"checkpoint part name {name!r} is taken")
        return name

    def add_state(self, name: str, part: Stateful) -> None:
        """A part saved as ``state.json[name] = part.state_dict()`` (rank 0's) and given back by
        ``part.load_state_dict``."""
        if not isinstance(part, Stateful):
            raise TypeError(f"checkpoint part {name!r}: {type(part).__name__} has no state_dict/load_state_dict")
        self._states[self._name(name, directory=False)] = part

    def add_engine(self, name: str, engine: ShardedEngine, *, save: bool = True) -> None:
        """A DeepSpeed engine, saved into ``name/ds`` by every rank (``save=False``: loaded at
        resume, never saved; a part of the run must then refuse a checkpoint without it)."""
        if not isinstance(engine, ShardedEngine):
            raise TypeError(f"checkpoint engine {name!r}: {type(engine).__name__} has no save/load_checkpoint")
        self._engines[self._name(name, directory=True)] = engine
        if not save:
            self._unsaved.add(name)

    def add_generator(self, name: str, generator: torch.Generator) -> None:
        """A torch.Generator, saved per rank beside the process's RNG states."""
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"checkpoint generator {name!r}: {type(generator).__name__} is not a torch.Generator")
        self._generators[self._name(name, directory=False)] = generator

    def add_export(self, name: str, write: Callable[[Path], None]) -> None:
        """``write(directory)`` on every rank into ``name/`` of each checkpoint; never read back."""
        self._exports[self._name(name, directory=True)] = write

    # ---- save
    def save(self, step: int) -> Path:
        """Writes checkpoint ``step`` atomically, then prunes; on every rank."""
        final = step_dir(self.root, step)
        partial = self.root / f".{final.name}.partial"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a save of this step killed earlier
            partial.mkdir()
        _barrier()
        for name, engine in self._engines.items():
            if name in self._unsaved:
                continue
            (partial / name).mkdir(exist_ok=True)
            engine.save_checkpoint(str(partial / name), tag=DS_TAG, client_state={})  # collective
        rng = {**rng_state(), "generators": {n: g.get_state() for n, g in self._generators.items()}}
        (partial / RNG_DIR).mkdir(exist_ok=True)
        torch.save(rng, partial / RNG_DIR / f"rank_{self.rank}.pt")
        for name, write in self._exports.items():
            write(partial / name)  # collective
        state: dict[str, Any] = {}
        if self.rank == 0:
            state = {"format": FORMAT, "step": step, "match": self.match}
            state.update({name: part.state_dict() for name, part in self._states.items()})
            _write_json(partial / STATE_FILE, state)
        _barrier()  # every rank's files are down before the manifest lists them
        sizes = _broadcast(manifest.file_sizes(partial) if self.rank == 0 else None)
        mine = manifest.checksums(partial, manifest.shares(sizes, self.world_size)[self.rank]) if self.checksums else {}
        sums = {k: v for part in _all_gather(mine) for k, v in part.items()}
        if self.rank == 0:
            manifest.write(partial, sizes, sums if self.checksums else None)  # last: the proof
            commit_dir(partial, final)
            self._prune(keep=final, state=state)
            log.info("saved checkpoint %s", final)
        _barrier()
        return final

    def _prune(self, keep: Path, state: Mapping[str, Any]) -> None:
        done = [(s, d) for s, d in checkpoints(self.root) if (d / manifest.MANIFEST).is_file()]
        kept = self.retain([s for s, _ in done], state)
        newest = set(sorted(s for s, _ in done)[-self.max_keep :])
        for step, old in done:
            if step not in kept and old != keep:
                shutil.rmtree(old, ignore_errors=True)
                log.info("removed old checkpoint %s (--max_ckpt_num %d)", old, self.max_keep)
        for step in sorted(kept - newest):
            log.info("kept checkpoint step %d besides the newest %d (the retention rule's choice)", step, self.max_keep)
        for debris in [*self.root.glob(".step_*.partial"), *self.root.glob(".step_*.old-*")]:
            shutil.rmtree(debris, ignore_errors=True)  # left by a save killed half-way

    # ---- resume
    def resume(self) -> Resumed | None:
        """Loads the checkpoint ``find`` chooses into every part; None when there is none.
        Raises CheckpointError (on every rank together) for a damaged, mismatched or
        incomplete one."""
        path = find(self.location, checksums=self.checksums)
        if path is None:
            if self.rank == 0:
                log.info("--load_checkpoint: no checkpoint in %s; starting afresh", self.root)
            return None
        error: CheckpointError | None = None
        try:
            state = read_state(path)
            check_match(state.get("match", {}), self.match, path)
            for name, part in self._states.items():
                if name not in state:
                    raise CheckpointMismatch(f"cannot resume from {path}: it holds no state for {name!r}")
                try:
                    part.load_state_dict(state[name])
                except Exception as e:  # every rank must hear of it before the engines' collectives
                    raise CheckpointMismatch(f"cannot resume from {path}: {name}: {e}") from e
        except CheckpointError as e:
            error = e
        _agree(error)
        for name, engine in self._engines.items():
            try:
                loaded, _ = engine.load_checkpoint(
                    str(path / name), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
                )
            except Exception as e:  # named for the user: DeepSpeed's own error names no checkpoint
                raise CheckpointError(
                    f"{path / name}: the {name} engine could not load it ({type(e).__name__}: {e})"
                ) from e
            if loaded is None:
                raise CheckpointError(f"{path / name}: the {name} engine found no checkpoint there (tag {DS_TAG})")
        rng = torch.load(path / RNG_DIR / f"rank_{self.rank}.pt", weights_only=False)
        for name, generator in self._generators.items():
            if name not in rng["generators"]:
                raise CheckpointMismatch(f"cannot resume from {path}: it holds no generator {name!r}")
            generator.set_state(rng["generators"][name])
        set_rng_state(rng)  # last: nothing above may draw from the restored streams
        if self.rank == 0:
            log.info("resumed from %s: step %d", path, state["step"])
        return Resumed(int(state["step"]), path, state)


def _write_json(path: Path, obj: Any) -> None:
    # fsync: the manifest that follows lists this file's size; it must be on disk first.
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
