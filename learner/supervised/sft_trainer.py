"""The SFT training run behind ``learner.train_sft`` (flags and docs there)."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from learner.algorithms.sft_loss import IGNORE_INDEX, sft_loss_of_logprobs
from learner.runtime import engine as E
from learner.runtime.flags import model_options
from learner.runtime.lora import apply_lora
from learner.runtime.models import check_packable, label_logprobs
from learner.supervised.checkpoint import check_resumable, trainer_checkpointer
from learner.supervised.sft_data import collate_packed, collate_padded, sft_sample
from learner.supervised.trainer import (
    Trainer,
    load_samples,
    make_train_engine,
    reduce_sums,
    setup_run,
    template,
    to_device,
)

if TYPE_CHECKING:
    from learner.train_sft import SFTConfig

log = logging.getLogger("rayless.sft")


class SFTTrainer(Trainer):
    name = "sft"
    cfg: SFTConfig

    def prepare_step(self, batches):
        # The step's response tokens over all ranks: one all-reduce per optimizer step.
        local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        return max(1.0, E.all_reduce_sum(float(local)))

    def loss(self, batch, global_tokens):
        logp = label_logprobs(self.engine, batch, tile_tokens=self.cfg.ds.logits_tile_tokens)
        loss, m = sft_loss_of_logprobs(logp, batch["labels"], global_tokens=global_tokens)
        # DeepSpeed averages gradients over ranks and accumulation steps; the loss is already
        # this micro-batch's share of the global mean, so undo both divisions.
        return loss * (self.world * self.accum), {"loss": m["nll"], "tokens": m["tokens"]}

    def evaluate(self, batches):
        sums = {"nll": 0.0, "tokens": 0.0}
        for batch in batches:
            batch = to_device(batch)
            logp = label_logprobs(self.engine, batch, tile_tokens=self.cfg.ds.logits_tile_tokens)
            _, m = sft_loss_of_logprobs(logp, batch["labels"], global_tokens=1.0)
            sums["nll"] += float(m["nll"] * m["tokens"])
            sums["tokens"] += float(m["tokens"])
        total = reduce_sums(sums)
        return {"loss": total["nll"] / max(total["tokens"], 1.0), "tokens": total["tokens"]}


def run(cfg: SFTConfig) -> None:
    info, tok = setup_run(cfg, "sft")
    data, packing = cfg.data, cfg.ds.packing_samples
    keys = [data.input_key] + ([data.output_key] if data.output_key else [])
    encode = functools.partial(
        sft_sample,
        tokenizer=tok,
        input_key=data.input_key,
        output_key=data.output_key or None,
        apply_chat_template=data.apply_chat_template,
        input_template=template(data),
        max_len=data.max_len,
        pretrain_mode=cfg.model.pretrain_mode_enable,
    )
    train, evals = load_samples(cfg, keys, encode)
    check_resumable(cfg, SFTTrainer.name, len(train))  # before the model loads: a wrong resume fails in seconds
    collate = collate_packed if packing else functools.partial(collate_padded, pad_id=tok.pad_token_id)

    checkpointing = cfg.model.gradient_checkpointing_enable
    model = E.load_causal_lm(cfg.model.model_name_or_path, **model_options(cfg.ds, checkpointing))
    if packing:
        check_packable(model, "SFT")  # before the engine: a refusal costs no DeepSpeed start-up
    # --ds.lora.rank > 0: only the adapters reach the optimizer
    model = apply_lora(model, cfg.ds.lora, gradient_checkpointing=checkpointing)
    engine, _ = make_train_engine(cfg, model, len(train), info.world_size)
    trainer = SFTTrainer(cfg, engine, train, collate, evals)
    log.info(
        "SFT: %d train / %d eval samples, %d optimizer steps (%d per epoch), grad accum %d, %s rows",
        len(train),
        len(evals or []),
        trainer.total_steps,
        trainer.steps_per_epoch,
        trainer.accum,
        "packed" if packing else "padded",
    )
    trainer.fit(trainer_checkpointer(cfg, trainer, tok, len(train)))
    E.save_hf(engine, tok, cfg.ckpt.output_dir)
    log.info("saved %s", cfg.ckpt.output_dir)
    torch.distributed.barrier()
