"""One optimizer step over several micro-batches: when a trained engine reduces its gradients.

Every trainer (policy, critic, SFT/RM/DPO) runs an optimizer step as ``N`` micro-batches of
forward/backward per rank. DeepSpeed's ZeRO-2 reduces the whole gradient after EVERY
micro-batch, so that a rank only ever keeps its shard; DDP and ZeRO-1 reduce once, at the
accumulation boundary. With ``--coalesce_grad_reduction`` a ZeRO-1/2/3 engine instead keeps the
micro-batches' gradients locally and reduces once per optimizer step, through DeepSpeed's own
``engine.coalesce_grad_reduction()``: ``N`` times fewer gradient reductions, the same gradient
(summed in another order: ``tests/unit/runtime/test_accumulation.py``), at the price of one
full local gradient per rank held between micro-batches (what ZeRO-1 holds anyway; DeepSpeed's
docs report ZeRO-2's peak falling on GPUs, since the per-micro-batch path's buckets go).

``auto`` coalesces where that was measured to pay: a CPU learner (gloo has no streams to hide
the reductions behind backward) at ZeRO-2 with 2+ data-parallel ranks and 2+ micro-batches
per step: ``bench/learner.py --model small --zero_stage 2 --nproc 2`` went from 1.20-1.25x to
1.08-1.13x the plain-torch (DDP) step (``docs/performance.md``). GPUs keep DeepSpeed's default
under ``auto``: there ``overlap_comm`` hides most of the per-micro-batch reduction behind
backward, and nothing was measured on GPUs here; ``on`` asks for it anywhere DeepSpeed
supports it.

The driving pattern is DeepSpeed's documented one for a caller that owns the boundary: the
boundary flag set before each backward, ``engine.step()`` once after the last. Uncoalesced
engines keep the per-micro-batch ``backward(); step()`` that DeepSpeed's managed accumulation
expects (and that the test fakes implement).

A step of a variable number of micro-batches (token-budget micro-batches,
``--train.dynamic_batch_enable``: ``learner.rl.micro_batches``) cannot use DeepSpeed's own
counter, which steps after ``gradient_accumulation_steps`` backwards, a number fixed when the
engine is built. ``OptimizerStep(engine, micro_batches=n)`` owns the boundary instead, coalesced
or not: False before each of the first n - 1 backwards, True before the last, ``engine.step()``
once after it. DeepSpeed still divides each loss by its fixed ``gradient_accumulation_steps``,
which the trainers' loss scale undoes whatever n is.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

from common.config import flag

__all__ = ["COALESCE_CHOICES", "coalesce_flag", "should_coalesce", "engine_coalesces", "OptimizerStep"]

log = logging.getLogger("rayless.engine")

COALESCE_CHOICES = ("auto", "on", "off")


def coalesce_flag(group: str, **kw: Any) -> Any:
    """The ``--coalesce_grad_reduction`` field of every trainer's config (one definition)."""
    return flag(
        "auto",
        "reduce ZeRO gradients once per optimizer step instead of after every micro-batch (DeepSpeed's "
        "coalesce_grad_reduction: 1/N the collectives, one full local gradient held between micro-batches); "
        "auto: on for CPU learners at ZeRO-2 with 2+ ranks and 2+ micro-batches, off on GPUs; on: wherever "
        "DeepSpeed supports it (ZeRO-1/2/3 without the bf16 wrapper)",
        choices=COALESCE_CHOICES,
        group=group,
        **kw,
    )


def should_coalesce(
    mode: str, *, device_type: str, zero_stage: int, dp_world_size: int, accum_steps: int, supported: bool
) -> bool:
    """Whether an engine of this shape reduces once per step under ``mode`` (see the module doc).

    ``supported``: DeepSpeed can coalesce this engine (a ZeRO-1/2/3 optimizer of its own, not
    the bf16/fp16 wrapper, no pipeline). One rank or one micro-batch has nothing to coalesce.
    """
    if mode not in COALESCE_CHOICES:
        raise ValueError(f"--coalesce_grad_reduction: {mode!r} is not one of {', '.join(COALESCE_CHOICES)}")
    if mode == "off" or not supported or dp_world_size < 2 or accum_steps < 2:
        return False
    if mode == "on":
        return True
    return device_type == "cpu" and zero_stage == 2


def engine_coalesces(engine: Any, mode: str, *, name: str = "model") -> bool:
    """``should_coalesce`` for a built DeepSpeed engine, said once in the log (rank 0) when it
    coalesces; anything else, such as a test's stand-in engine, never coalesces."""
    if not hasattr(engine, "coalesce_grad_reduction"):
        return False
    import torch  # here: the config modules import this file, and --help must not pay for torch

    stage = int(engine.zero_optimization_stage())
    supported = (
        stage in (1, 2, 3)
        and hasattr(engine.optimizer, "_coalesce_grad_reduction")  # DeepSpeed's own check at entry
        and not engine.pipeline_parallelism
        and engine.managed_gradient_accumulation()
    )
    accum = int(engine.gradient_accumulation_steps())
    coalesce = should_coalesce(
        mode,
        device_type=torch.device(engine.device).type,
        zero_stage=stage,
        dp_world_size=int(engine.dp_world_size),
        accum_steps=accum,
        supported=supported,
    )
    if coalesce and engine.global_rank == 0:
        log.info(
            "%s: ZeRO-%d gradients reduced once per optimizer step, not after each of its %d micro-batches "
            "(--coalesce_grad_reduction %s)",
            name,
            stage,
            accum,
            mode,
        )
    elif mode == "on" and not supported and engine.dp_world_size > 1 and accum > 1 and engine.global_rank == 0:
        log.warning(
            "%s: --coalesce_grad_reduction on: DeepSpeed cannot coalesce this engine (ZeRO-%d, optimizer %s); "
            "reducing after every micro-batch",
            name,
            stage,
            type(engine.optimizer).__name__,
        )
    return coalesce


class OptimizerStep:
    """The micro-batches of one optimizer step on one trained engine::

        with OptimizerStep(engine, coalesce=...) as step:
            for batch in micro_batches:        # exactly engine.gradient_accumulation_steps()
                step.backward(loss_of(batch))
        # the optimizer has stepped

    Uncoalesced: ``engine.backward(loss); engine.step()`` per micro-batch (DeepSpeed's managed
    accumulation steps the optimizer at the last). Coalesced: inside
    ``engine.coalesce_grad_reduction()``, the boundary set before each backward and
    ``engine.step()`` once after the block's single reduction. ``micro_batches=n``: a step of n
    micro-batches whatever the engine's accumulation steps, the boundary set before each
    backward (True before the n-th) and ``engine.step()`` once after the last, coalesced or not.
    Every rank must run the same number of backwards: the reduction is a collective, and a count
    that is not the planned one (the engine's accumulation steps, or n) is an error rather than a
    step on a partial gradient.
    """

    def __init__(self, engine: Any, *, coalesce: bool, micro_batches: int | None = None) -> None:
        self.engine = engine
        self.coalesce = coalesce
        self.accum = int(engine.gradient_accumulation_steps())
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"OptimizerStep: an optimizer step needs at least one micro-batch, got {micro_batches}")
        self.planned = micro_batches  # None: the engine's accumulation steps, DeepSpeed's counter
        self.count = self.accum if micro_batches is None else micro_batches
        # The boundary is ours to set when coalescing or when the count is not DeepSpeed's.
        self.own_boundary = coalesce or micro_batches is not None
        self.done = 0
        self._block: Any = None

    def __enter__(self) -> OptimizerStep:
        if self.coalesce:
            self._block = self.engine.coalesce_grad_reduction()
            self._block.__enter__()
        return self

    def _what(self) -> str:
        return f"the engine's {self.accum}" if self.planned is None else f"the {self.planned} planned"

    def _set_boundary(self, is_boundary: bool) -> None:
        # A test's stand-in engine without DeepSpeed's boundary accumulates and steps as asked.
        if hasattr(self.engine, "set_gradient_accumulation_boundary"):
            self.engine.set_gradient_accumulation_boundary(is_boundary)

    def backward(self, loss: Any) -> None:
        if self.done >= self.count:
            raise RuntimeError(f"OptimizerStep: more than {self._what()} micro-batches in one step")
        self.done += 1
        if self.own_boundary:
            self._set_boundary(self.done == self.count)
            self.engine.backward(loss)
        else:
            self.engine.backward(loss)
            self.engine.step()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._block is not None:
            block, self._block = self._block, None
            # DeepSpeed's block reduces on exit (a collective), after a failure too: as uncoalesced
            # ranks would meet in their next per-micro-batch reduction.
            block.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return
        if self.done != self.count:
            where = f"the engine accumulates {self.accum}" if self.planned is None else f"{self.planned} were planned"
            raise RuntimeError(
                f"OptimizerStep: {self.done} micro-batches where {where}: the step would train on part of the batch"
            )
        if self.own_boundary:
            self._set_boundary(True)
            self.engine.step()
