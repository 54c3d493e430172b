"""An exponential moving average of a model's trained parameters (``--train.enable_ema``).

After every optimizer step of the model, for every parameter that trains (with LoRA: the
adapters only; the frozen base has no average that differs from itself)::

    ema = beta * ema + (1 - beta) * weights            (ema starts at the weights it is given)

The average is kept in fp32 in host memory, each rank holding 1/N of it: under ZeRO-3 its own
partition of every parameter (``p.ds_tensor``, DeepSpeed's layout, padding included), otherwise
the same slice of the flattened parameter (every rank holds the whole parameter, identical on
all of them after the step). An update therefore reads only what the rank holds and
communicates nothing; memory: 4 bytes x trained parameters / N per rank, on the host.

Saving the average as a model (``save_hf``) puts it into the model's parameters for the
duration of the save and restores the trained values exactly afterwards (``applied``): the HF
writer, LoRA's merge, tied weights and ZeRO-3's gathers are then the trained model's own. The
trained values wait in host memory meanwhile (ZeRO-3: each rank its partitions; otherwise rank
0 the whole trained parameters, the others nothing). The average's shards go into checkpoints
through the checkpoint manager's engine interface (``save_checkpoint`` / ``load_checkpoint``):
one file per rank, ``<dir>/<tag>/rank_<r>.pt``, restored bit-exactly.

How it differs from OpenRLHF's (``DeepspeedStrategy.moving_average``, the same formula and the
same moment, after each optimizer step): there the average is a second model in the training
dtype (bf16 by default, where a step of (1 - beta) x the difference is mostly below the
rounding of the average, so it barely moves), whole on every GPU below ZeRO-3 and gathered in
full with the trained model at every update under ZeRO-3; it is not in checkpoints, so a
resumed run restarts it from the pretrained weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.weights.source import unwrap

__all__ = ["EMA"]


def _zero3(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_tensor")


def _partitioned(p: Any) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return p.ds_status == ZeroParamStatus.NOT_AVAILABLE


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class EMA:
    """The moving average of ``model``'s trained parameters (an engine or a module), started
    at their current values. Built, updated, saved and loaded on every rank together."""

    def __init__(self, model: Any, beta: float) -> None:
        if not 0 < beta < 1:
            raise ValueError(f"EMA beta must be in (0, 1), got {beta}")
        self.beta = beta
        self.updates = 0  # optimizer steps averaged since the start (across resumes)
        self.rank, self.world = _world()
        module = unwrap(model)
        self._params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("EMA: the model has no trained parameters")
        # name -> (S,) fp32 on CPU: this rank's share of the average, S = ceil(numel / N)
        self.shards: dict[str, torch.Tensor] = {}
        for name, p in self._params:
            own = self._own(p)
            shard = torch.zeros(self._shard_size(p), dtype=torch.float32)
            shard[: own.numel()] = own.to("cpu", torch.float32)
            self.shards[name] = shard

    # ------------------------------------------------------------------ the rank's share
    def _shard_size(self, p: torch.Tensor) -> int:
        return p.ds_tensor.numel() if _zero3(p) else -(-p.numel() // self.world)

    def _own(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``p``'s current values, 1-D: its ZeRO-3 partition, or elements
        ``[r S, (r + 1) S)`` of the flattened parameter (the last rank's cut short, maybe empty)."""
        if _zero3(p):
            return p.ds_tensor.detach().view(-1)
        s = self._shard_size(p)
        return p.detach().reshape(-1)[self.rank * s : (self.rank + 1) * s]

    def nbytes(self) -> int:
        """Host memory the average takes on this rank."""
        return sum(t.numel() * t.element_size() for t in self.shards.values())

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: ``ema = beta ema + (1 - beta) weights`` on this rank's share."""
        for name, p in self._params:
            own = self._own(p)
            shard = self.shards[name][: own.numel()]
            # a device-to-host copy of the share on GPUs; the arithmetic is fp32 on the host
            shard.mul_(self.beta).add_(own.to("cpu", torch.float32), alpha=1 - self.beta)
        self.updates += 1

    # ------------------------------------------------------------------ the average as a model
    def _gather(self, name: str, numel: int) -> torch.Tensor | None:
        """The whole average of one parameter (flat, fp32, CPU) on rank 0, None elsewhere. A
        collective when there are several ranks (through the accelerator with NCCL)."""
        shard = self.shards[name]
        if self.world == 1:
            return shard[:numel]
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else shard.device
        parts = [torch.empty_like(shard, device=on) for _ in range(self.world)]
        dist.all_gather(parts, shard.to(on))
        return torch.cat(parts)[:numel].cpu() if self.rank == 0 else None

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block the model's trained parameters hold the average (in their dtype), as
        far as a save reads them: under ZeRO-3 every rank's partitions, otherwise rank 0's
        parameters. Restored bit-exactly on leaving. Every rank enters it together. Nothing may
        train or push weights inside."""
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, its trained values on the host)
        try:
            with torch.no_grad():
                gathered = [p for _, p in self._params if _zero3(p) and not _partitioned(p)]
                if gathered:
                    # whole on every rank (ZeRO-3's persistent small parameters): partitioned, a save
                    # gathers them again from the partitions, which is where the average goes
                    gathered[0].partition(param_list=gathered)
                for name, p in self._params:
                    if _zero3(p):
                        live = p.ds_tensor.data.view(-1)
                        value: torch.Tensor | None = self.shards[name]
                    else:
                        value = self._gather(name, p.numel())
                        live = p.data.view(-1)
                        if value is None:  # not rank 0: its copy is not read by a save
                            continue
                    saved.append((live, live.to("cpu", copy=True)))
                    live.copy_(value)
            yield
        finally:
            with torch.no_grad():
                for live, trained in saved:
                    live.copy_(trained)

    def save_hf(self, model: Any, tokenizer: Any, path: str | Path) -> None:
        """``model`` with the average in place of its trained parameters, written in HF format to
        ``path`` as ``learner.runtime.engine.save_hf`` writes the model itself (LoRA: merged, the
        adapter beside it). On every rank."""
        from learner.runtime import engine as E

        with self.applied():
            E.save_hf(model, tokenizer, path)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any] | None = None) -> None:
        """This rank's shards into ``save_dir/tag/rank_<r>.pt`` (the checkpoint manager's engine
        interface, ``learner.runtime.checkpoint.ShardedEngine``)."""
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        state = {"beta": self.beta, "updates": self.updates, "world_size": self.world, "shards": self.shards}
        torch.save(state, d / f"rank_{self.rank}.pt")

    def load_checkpoint(self, load_dir: str, tag: str, **_: Any) -> tuple[str, dict[str, Any]]:
        """This rank's shards back from ``save_checkpoint``'s file, bit-exactly; the shards must
        be of the same parameters, ranks and partitions (ValueError naming the first that is not).
        ``beta`` is this run's (it may change across a restart, as the learning rate may)."""
        path = Path(load_dir) / tag / f"rank_{self.rank}.pt"
        if not path.is_file():
            raise ValueError(f"{path}: no moving average of rank {self.rank} (saved without --train.enable_ema?)")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["world_size"] != self.world:
            raise ValueError(f"{path}: an average of {state['world_size']} ranks, this run has {self.world}")
        saved = state["shards"]
        if set(saved) != set(self.shards):
            diff = sorted(set(saved) ^ set(self.shards))
            raise ValueError(f"{path}: an average of other parameters ({', '.join(diff[:3])} ...)")
        for name, shard in self.shards.items():
            if saved[name].shape != shard.shape:
                raise ValueError(f"{path}: {name}: a shard of {tuple(saved[name].shape)}, here {tuple(shard.shape)}")
        for name, shard in self.shards.items():
            shard.copy_(saved[name])
        self.updates = int(state["updates"])
        return str(load_dir), {}
