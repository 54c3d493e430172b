"""The DPO training run behind ``learner.train_dpo`` (flags and docs there)."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from learner.algorithms.dpo_loss import dpo_loss
from learner.runtime import engine as E
from learner.runtime.flags import model_options
from learner.runtime.lora import apply_lora
from learner.runtime.models import sequence_logprobs
from learner.supervised.checkpoint import check_resumable, trainer_checkpointer
from learner.supervised.rm_data import collate_pairs, pair_sample
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
    from learner.train_dpo import DPOConfig

log = logging.getLogger("rayless.dpo")


class DPOTrainer(Trainer):
    name = "dpo"
    cfg: DPOConfig

    def __init__(self, cfg, engine, ref_engine, *args, **kwargs) -> None:
        super().__init__(cfg, engine, *args, **kwargs)
        self.ref = ref_engine

    def _logps(self, model, batch):
        logp, tokens = sequence_logprobs(model, batch, tile_tokens=self.cfg.ds.logits_tile_tokens, packed=False)
        half = logp.shape[0] // 2
        return logp[:half], logp[half:], tokens[:half]

    def _loss(self, batch):
        with torch.no_grad():
            ref_c, ref_r, _ = self._logps(self.ref, batch)
        pol_c, pol_r, n_chosen = self._logps(self.engine, batch)
        model = self.cfg.model
        return dpo_loss(
            pol_c,
            pol_r,
            ref_c,
            ref_r,
            beta=model.beta,
            label_smoothing=model.label_smoothing,
            ipo=model.ipo_enable,
            nll_loss_coef=model.nll_loss_coef,
            chosen_tokens=n_chosen,
        )

    def loss(self, batch, ctx):
        loss, m = self._loss(batch)
        return loss, {"loss": loss.detach(), **m}

    def evaluate(self, batches):
        sums: dict[str, float] = {}
        pairs = 0.0
        for batch in batches:
            loss, m = self._loss(to_device(batch))
            n = float(batch["margin"].shape[0])
            pairs += n
            for k, v in {"loss": loss, **m}.items():
                sums[k] = sums.get(k, 0.0) + float(v) * n
        sums["pairs"] = pairs
        t = reduce_sums(sums)
        n = max(t.pop("pairs"), 1.0)
        return {k: v / n for k, v in t.items()}


def run(cfg: DPOConfig) -> None:
    info, tok = setup_run(cfg, "dpo")
    data, ds = cfg.data, cfg.ds
    encode = functools.partial(
        pair_sample,
        tokenizer=tok,
        prompt_key=data.prompt_key or None,
        chosen_key=data.chosen_key,
        rejected_key=data.rejected_key,
        apply_chat_template=data.apply_chat_template,
        input_template=template(data),
        max_len=data.max_len,
    )
    train, evals = load_samples(cfg, data.keys(), encode)
    check_resumable(cfg, DPOTrainer.name, len(train))  # before the model loads: a wrong resume fails in seconds
    collate = functools.partial(collate_pairs, pad_id=tok.pad_token_id)

    checkpointing = cfg.model.gradient_checkpointing_enable
    model = E.load_causal_lm(cfg.model.model_name_or_path, **model_options(ds, checkpointing))
    model = apply_lora(model, ds.lora, gradient_checkpointing=checkpointing)  # --ds.lora.rank > 0
    engine, _ = make_train_engine(cfg, model, len(train), info.world_size)
    # The reference: its path defaults to the policy's (DPOConfig); frozen, so no checkpointing.
    ref = E.load_causal_lm(cfg.ref.model_name_or_path, **model_options(ds, gradient_checkpointing=False))
    ref_engine = E.make_frozen_engine(ref, zero_stage=ds.zero_stage, bf16=ds.bf16, offload=cfg.ref.offload)
    trainer = DPOTrainer(cfg, engine, ref_engine, train, collate, evals)
    log.info(
        "DPO: %d train / %d eval pairs, %d optimizer steps, grad accum %d, beta %g%s",
        len(train),
        len(evals or []),
        trainer.total_steps,
        trainer.accum,
        cfg.model.beta,
        " (IPO)" if cfg.model.ipo_enable else f", label smoothing {cfg.model.label_smoothing}",
    )
    trainer.fit(trainer_checkpointer(cfg, trainer, tok, len(train)))
    E.save_hf(engine, tok, cfg.ckpt.output_dir)
    log.info("saved %s", cfg.ckpt.output_dir)
