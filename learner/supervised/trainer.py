"""What the SFT, RM and DPO trainers share: their common flags, run set-up, data
sharding, the optimizer-step loop with logging, evaluation and checkpoints (saved and
resumed by ``learner.runtime.checkpoint``, the RL run's manager; parts: ``learner.supervised.checkpoint``).

The loop (``Trainer.fit``) works in optimizer steps: it draws the step's ``grad_accum``
micro-batches first (so a loss can be normalised by the step's global token count, see
``learner.algorithms.sft_loss``), then runs forward/backward/``engine.step()`` on each. Every rank
sees a disjoint shard of each epoch's seeded permutation (``DistributedSampler``,
``drop_last``), so a resumed run skips exactly the micro-batches already trained on.

Logged metrics go to the log, to ``{ckpt.output_dir}/train_log.jsonl`` (one JSON object per
logging or eval step, rank 0, written by ``learner.runtime.metrics.MetricsWriter`` as RL's
metrics are), with ``--logger.tensorboard_dir DIR`` (``--use_tensorboard``) to TensorBoard under
``DIR/<sft|rm|dpo>``, and with ``--logger.wandb.key`` (``--use_wandb``) to Weights & Biases (a
resumed run continues its wandb run: the id is in the checkpoint's client state).

Import this module only after the config is parsed: it imports torch and DeepSpeed. The
config part lives in ``learner.supervised.config`` so ``--help`` stays fast.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from learner.runtime import engine as E
from learner.runtime.accumulation import OptimizerStep, engine_coalesces
from learner.runtime.checkpoint import Checkpointer
from learner.runtime.determinism import seed_everything
from learner.runtime.flags import engine_options
from learner.runtime.metrics import MetricsWriter
from learner.supervised.config import DataSection, EvalSection, TrainerConfig, TrainSection

log = logging.getLogger("rayless.trainer")


def setup_run(cfg: TrainerConfig, name: str):
    """Logging, seeds, process group, tokenizer. Returns ``(dist_info, tokenizer)``."""
    from common.config import log_config

    # First: --full_determinism's cuBLAS workspace is read when CUDA makes its first handle.
    seed_everything(cfg.train.seed, full_determinism=cfg.train.full_determinism_enable)
    info = E.init_distributed()
    logging.basicConfig(
        level=logging.INFO if info.rank == 0 else logging.WARNING,
        format=f"%(asctime)s {name}[{info.rank}] %(levelname)s %(message)s",
        force=True,
    )
    if info.rank == 0:
        log_config(cfg, log)
        for notice in cfg.notices:  # what the flags' checks found, said once logging is up
            log.warning("%s", notice)
    E.set_host_malloc(cfg.ds.host_malloc)
    return info, load_tokenizer(cfg.model.model_name_or_path, cfg.data)


def load_tokenizer(path: str, data: DataSection):
    """The fast tokenizer of ``path``, with ``--data.tokenizer_chat_template`` when given."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, use_fast=True)
    if data.tokenizer_chat_template:
        tok.chat_template = data.tokenizer_chat_template
    if tok.pad_token is None:
        # Our collators pad with an attention mask and read rewards from it, so pad = eos is safe.
        tok.pad_token = tok.eos_token
    return tok


def build_samples(rows, encode: Callable[[dict[str, Any]], Any], what: str) -> list[Any]:
    """Encode rows (a ``datasets.Dataset``); rows encoding to None are dropped and counted."""
    samples, dropped, first = [], 0, None
    for row in rows:
        s = encode(row)
        if s is None:
            dropped += 1
            first = first or f"{row.get('_source')}, row {row.get('_row')}"
        else:
            samples.append(s)
    if dropped:
        log.warning(
            "%s: dropped %d rows with no response token left within --data.max_len (first: %s)", what, dropped, first
        )
    return samples


def load_samples(
    cfg: TrainerConfig, keys: Sequence[str], encode: Callable[[dict[str, Any]], Any]
) -> tuple[list[Any], list[Any] | None]:
    """The encoded training samples and the ``--eval.dataset`` ones (None when none is given)."""
    train = build_samples(load_rows(cfg.data, keys, seed=cfg.train.seed), encode, "train")
    eval_rows = load_rows(cfg.data, keys, seed=cfg.train.seed, evaluation=cfg.eval)
    return train, (build_samples(eval_rows, encode, "eval") if eval_rows is not None else None)


def template(data: DataSection) -> str | None:
    """``--data.input_template``, None when empty (its ``{}`` is checked when the flags parse)."""
    return data.input_template or None


def load_rows(data: DataSection, keys: Sequence[str], *, seed: int, evaluation: EvalSection | None = None):
    """The training rows (or, given the ``eval`` section, its ``--eval.dataset`` rows), key-checked;
    None when no eval data is given."""
    from common.datasets import SkipCounter, load_mixed

    source = evaluation.dataset if evaluation is not None else data.dataset
    if not source:
        return None
    skipped = SkipCounter()
    ds = load_mixed(
        source,
        probs=None if evaluation is not None else data.dataset_probs,
        split=evaluation.split if evaluation is not None else data.dataset_split,
        max_samples=data.max_samples,
        seed=seed,
        required_keys=keys,
        skip_bad_rows=data.skip_bad_rows,
        skipped=skipped,
    )
    if skipped.total:
        log.warning("%s: %s", source, skipped.report())
    return ds


def to_device(batch: dict[str, Any]) -> dict[str, Any]:
    dev = E.device()
    return {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def loader(samples: Sequence[Any], collate: Callable, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool):
    """This rank's shard of ``samples`` in micro-batches (the sampler is ``loader.sampler``)."""
    from torch.utils.data import DataLoader, DistributedSampler

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    sampler = DistributedSampler(
        samples, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return DataLoader(samples, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=drop_last)


def steps_per_epoch(n_samples: int, train: TrainSection, world: int) -> int:
    """Optimizer steps in one epoch; raises when the data cannot fill one step."""
    from learner.runtime.deepspeed_config import grad_accum_steps

    accum = grad_accum_steps(train.batch_size, train.micro_batch_size, world)
    steps = (n_samples // world // train.micro_batch_size) // accum
    if steps < 1:
        raise ValueError(
            f"{n_samples} training samples cannot fill one optimizer step of --train_batch_size {train.batch_size}"
        )
    return steps


def mean_metrics(per_micro: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Mean over micro-batches, then over ranks (one all-reduce for the whole dict)."""
    keys = per_micro[0].keys()
    local = {k: float(torch.stack([m[k].float().cpu() for m in per_micro]).mean()) for k in keys}
    return E.all_reduce_mean(local)


class Trainer:
    """The optimizer-step loop; subclasses give ``loss`` and ``evaluate`` (and may override
    ``prepare_step``). ``engine`` is the trained DeepSpeed engine; a subclass narrows ``cfg`` to
    its trainer's config."""

    name = "train"

    def __init__(
        self,
        cfg: TrainerConfig,
        engine: Any,
        train_samples: Sequence[Any],
        collate: Callable,
        eval_samples: Sequence[Any] | None = None,
    ) -> None:
        self.cfg, self.engine = cfg, engine
        self.collate = collate
        train = cfg.train
        self.train_loader = loader(
            train_samples, collate, train.micro_batch_size, shuffle=True, seed=train.seed, drop_last=True
        )
        self.eval_loader = (
            loader(eval_samples, collate, train.micro_batch_size, shuffle=False, seed=train.seed, drop_last=False)
            if eval_samples
            else None
        )
        self.accum = engine.gradient_accumulation_steps()
        # Gradients reduced once per optimizer step, not per micro-batch (--ds.coalesce_grad_reduction)
        self.coalesce = engine_coalesces(engine, cfg.ds.coalesce_grad_reduction, name=self.name)
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.steps_per_epoch = len(self.train_loader) // self.accum
        self.total_steps = self.steps_per_epoch * train.max_epochs
        self.metrics: MetricsWriter | None = None  # rank 0 only
        if E.is_rank0():
            from learner.runtime.tracking import public_config
            from learner.runtime.wandb_sink import wandb_sink

            logger, out = cfg.logger, cfg.ckpt.output_dir
            tb_dir = Path(logger.tensorboard_dir) / self.name if logger.tensorboard_dir else None
            # wandb's run is finished by its exit hook when the process ends (after the final save).
            wandb = wandb_sink(logger.wandb, trainer=f"train_{self.name}", config=public_config(cfg), folder=out)
            self.metrics = MetricsWriter(Path(out) / "train_log.jsonl", tb_dir, wandb=wandb)
        self.global_step = 0
        self.last_eval: tuple = (-1, {})  # (step, metrics) of the latest evaluation

    # ---- hooks
    def prepare_step(self, batches: list[dict[str, Any]]) -> Any:
        return None

    def loss(self, batch: dict[str, Any], step_ctx: Any):  # -> (loss, metrics of 0-dim tensors)
        raise NotImplementedError

    def evaluate(self, batches: Iterable[dict[str, Any]]) -> dict[str, float]:
        """Metrics over the eval micro-batches ``batches`` (this rank's shard), reduced over ranks."""
        raise NotImplementedError

    # ---- loop
    def log_metrics(self, metrics: dict[str, float], prefix: str) -> None:
        if self.metrics is None:
            return
        self.metrics.write(self.global_step, metrics, prefix)
        log.info("%s step %d: %s", prefix, self.global_step, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def run_eval(self) -> dict[str, float]:
        if self.eval_loader is None:
            return {}
        self.engine.eval()
        with torch.no_grad():
            result = self.evaluate(self.eval_loader)
        self.engine.train()
        self.log_metrics(result, "eval")
        self.last_eval = (self.global_step, result)
        return result

    # ---- a checkpoint part (learner.supervised.checkpoint)
    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = int(state["global_step"])
        if not 0 <= step <= self.total_steps:
            raise ValueError(f"optimizer step {step} is outside this run's {self.total_steps} steps")
        self.global_step = step

    def fit(self, ckpt: Checkpointer) -> None:
        """Trains to the end, resuming from ``ckpt`` first with --ckpt.load_enable and saving
        into it every --ckpt.save_steps optimizer steps."""
        cfg = self.cfg
        if cfg.ckpt.load_enable and ckpt.resume() is not None:
            log.info("resumed at optimizer step %d of %d", self.global_step, self.total_steps)
        if cfg.eval.at_start and self.global_step == 0:
            self.run_eval()
        eval_every = cfg.eval.steps if cfg.eval.steps > 0 else self.steps_per_epoch
        self.engine.train()
        t0, samples_since = time.time(), 0
        start_epoch = self.global_step // self.steps_per_epoch
        for epoch in range(start_epoch, cfg.train.max_epochs):
            self.train_loader.sampler.set_epoch(epoch)
            batches = iter(self.train_loader)
            done_in_epoch = self.global_step - epoch * self.steps_per_epoch
            for _ in range(done_in_epoch * self.accum):  # resume: skip what was trained on
                next(batches)
            for _ in range(self.steps_per_epoch - done_in_epoch):
                step_batches = [next(batches) for _ in range(self.accum)]
                ctx = self.prepare_step(step_batches)
                per_micro = []
                with OptimizerStep(self.engine, coalesce=self.coalesce) as step:
                    for batch in step_batches:
                        loss, metrics = self.loss(to_device(batch), ctx)
                        step.backward(loss)
                        per_micro.append(metrics)
                self.global_step += 1
                samples_since += cfg.train.batch_size
                if self.global_step % cfg.logger.logging_steps == 0 or self.global_step == self.total_steps:
                    m = mean_metrics(per_micro)
                    elapsed = time.time() - t0
                    m.update(
                        lr=self.engine.get_lr()[0], epoch=epoch + 1, samples_per_s=samples_since / max(elapsed, 1e-9)
                    )
                    t0, samples_since = time.time(), 0
                    self.log_metrics(m, "train")
                if self.global_step % eval_every == 0:
                    self.run_eval()
                if cfg.ckpt.save_steps > 0 and self.global_step % cfg.ckpt.save_steps == 0:
                    ckpt.save(self.global_step)


def make_train_engine(cfg: TrainerConfig, model: torch.nn.Module, n_train: int, world: int):
    """The trained engine with the common optimizer flags; also returns steps per epoch."""
    per_epoch = steps_per_epoch(n_train, cfg.train, world)
    engine = E.make_engine(
        model,
        **engine_options(cfg.ds, cfg),  # the optimizer fields are the config's top level (OpenRLHF's layout)
        train_batch_size=cfg.train.batch_size,
        micro_train_batch_size=cfg.train.micro_batch_size,
        num_training_steps=per_epoch * cfg.train.max_epochs,
    )
    return engine, per_epoch


def reduce_sums(sums: dict[str, float]) -> dict[str, float]:
    return E.all_reduce_sum(sums)
