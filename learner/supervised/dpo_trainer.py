"""The DPO training run behind ``learner.train_dpo`` (flags and docs there)."""

from __future__ import annotations

import functools
import logging

import torch

from learner.algorithms.dpo_loss import dpo_loss
from learner.runtime import engine as E
from learner.runtime.lora import apply_lora
from learner.runtime.models import forward_logits, sequence_logprobs
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

log = logging.getLogger("rayless.dpo")


class DPOTrainer(Trainer):
    name = "dpo"

    def __init__(self, cfg, engine, ref_engine, *args, **kwargs) -> None:
        super().__init__(cfg, engine, *args, **kwargs)
        self.ref = ref_engine

    def _logps(self, model, batch):
        logp, tokens = sequence_logprobs(forward_logits(model, batch, packed=False), batch["labels"])
        half = logp.shape[0] // 2
        return logp[:half], logp[half:], tokens[:half]

    def _loss(self, batch):
        with torch.no_grad():
            ref_c, ref_r, _ = self._logps(self.ref, batch)
        pol_c, pol_r, n_chosen = self._logps(self.engine, batch)
        return dpo_loss(
            pol_c,
            pol_r,
            ref_c,
            ref_r,
            beta=self.cfg.beta,
            label_smoothing=self.cfg.label_smoothing,
            ipo=self.cfg.ipo,
            nll_loss_coef=self.cfg.nll_loss_coef,
            chosen_tokens=n_chosen,
        )

    def loss(self, batch, ctx):
        loss, m = self._loss(batch)
        return loss, {"loss": loss.detach(), **m}

    def evaluate(self):
        sums = {}
        pairs = 0.0
        for batch in self.eval_loader:
            loss, m = self._loss(to_device(batch))
            n = float(batch["margin"].shape[0])
            pairs += n
            for k, v in {"loss": loss, **m}.items():
                sums[k] = sums.get(k, 0.0) + float(v) * n
        sums["pairs"] = pairs
        t = reduce_sums(sums)
        n = max(t.pop("pairs"), 1.0)
        return {k: v / n for k, v in t.items()}


def run(cfg) -> None:
    info, tok = setup_run(cfg, "dpo")
    keys = ([cfg.prompt_key] if cfg.prompt_key else []) + [cfg.chosen_key, cfg.rejected_key]
    encode = functools.partial(
        pair_sample,
        tokenizer=tok,
        prompt_key=cfg.prompt_key or None,
        chosen_key=cfg.chosen_key,
        rejected_key=cfg.rejected_key,
        apply_chat_template=cfg.apply_chat_template,
        input_template=template(cfg),
        max_len=cfg.max_len,
    )
    train, evals = load_samples(cfg, keys, encode)
    check_resumable(cfg, DPOTrainer.name, len(train))  # before the model loads: a wrong resume fails in seconds
    collate = functools.partial(collate_pairs, pad_id=tok.pad_token_id)

    model = apply_lora(E.load_causal_lm(cfg.pretrain, **cfg.model_options()), cfg)  # --lora_rank > 0
    engine, _ = make_train_engine(cfg, model, len(train), info.world_size)
    ref = E.load_causal_lm(
        cfg.ref_pretrain or cfg.pretrain, zero_stage=cfg.zero_stage, bf16=cfg.bf16, flash_attn=cfg.flash_attn
    )
    ref_engine = E.make_frozen_engine(ref, zero_stage=cfg.zero_stage, bf16=cfg.bf16, offload=cfg.ref_offload)
    trainer = DPOTrainer(cfg, engine, ref_engine, train, collate, evals)
    log.info(
        "DPO: %d train / %d eval pairs, %d optimizer steps, grad accum %d, beta %g%s",
        len(train),
        len(evals or []),
        trainer.total_steps,
        trainer.accum,
        cfg.beta,
        " (IPO)" if cfg.ipo else f", label smoothing {cfg.label_smoothing}",
    )
    trainer.fit(trainer_checkpointer(cfg, trainer, tok, len(train)))
    E.save_hf(engine, tok, cfg.save_path)
    log.info("saved %s", cfg.save_path)
