"""The reward-model training run behind ``learner.train_rm`` (flags and docs there)."""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING

import torch

from learner.algorithms.rm_loss import reward_model_loss
from learner.runtime import engine as E
from learner.runtime.flags import model_options
from learner.runtime.lora import apply_lora
from learner.runtime.models import load_reward_model
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
    from learner.train_rm import RMConfig

log = logging.getLogger("rayless.rm")


class RMTrainer(Trainer):
    name = "rm"
    cfg: RMConfig
    reward_mean, reward_std = 0.0, 1.0

    def _rewards(self, batch):
        rewards = self.engine(batch["input_ids"], batch["attention_mask"])  # (2B,)
        half = rewards.shape[0] // 2
        return rewards[:half], rewards[half:]

    def loss(self, batch, ctx):
        chosen, rejected = self._rewards(batch)
        model = self.cfg.model
        margin = batch["margin"] if model.margin_loss_enable else None
        loss, m = reward_model_loss(chosen, rejected, loss=model.loss_type, margin=margin)
        return loss, {"loss": loss.detach(), **m}

    def evaluate(self, batches):
        sums = dict(pairs=0.0, correct=0.0, loss=0.0, r_sum=0.0, r_sq=0.0, margin=0.0)
        model = self.cfg.model
        for batch in batches:
            batch = to_device(batch)
            chosen, rejected = self._rewards(batch)
            margin = batch["margin"] if model.margin_loss_enable else None
            loss, _ = reward_model_loss(chosen, rejected, loss=model.loss_type, margin=margin)
            n = chosen.shape[0]
            both = torch.cat([chosen, rejected]).double()
            sums["pairs"] += n
            sums["correct"] += float((chosen > rejected).sum())
            sums["loss"] += float(loss) * n
            sums["margin"] += float((chosen - rejected).sum())
            sums["r_sum"] += float(both.sum())
            sums["r_sq"] += float((both**2).sum())
        t = reduce_sums(sums)
        n, count = max(t["pairs"], 1.0), max(2 * t["pairs"], 1.0)
        mean = t["r_sum"] / count
        # Population std over every chosen and rejected reward (what normalisation divides by).
        std = math.sqrt(max(t["r_sq"] / count - mean**2, 0.0))
        self.reward_mean, self.reward_std = mean, std if std > 0 else 1.0
        return {
            "loss": t["loss"] / n,
            "acc": t["correct"] / n,
            "reward_margin": t["margin"] / n,
            "reward_mean": mean,
            "reward_std": std,
        }


def run(cfg: RMConfig) -> None:
    info, tok = setup_run(cfg, "rm")
    data, margin = cfg.data, cfg.model.margin_loss_enable
    encode = functools.partial(
        pair_sample,
        tokenizer=tok,
        prompt_key=data.prompt_key or None,
        chosen_key=data.chosen_key,
        rejected_key=data.rejected_key,
        margin_key=data.margin_key if margin else None,
        apply_chat_template=data.apply_chat_template,
        input_template=template(data),
        max_len=data.max_len,
        force_eos=True,
    )
    train, evals = load_samples(cfg, data.keys(margin=margin), encode)
    check_resumable(cfg, RMTrainer.name, len(train))  # before the model loads: a wrong resume fails in seconds
    if evals is None:  # OpenRLHF: reward statistics over 1% of the training rows
        evals = train[: max(cfg.train.micro_batch_size * info.world_size, len(train) // 100)]
        log.info("no --eval.dataset: eval metrics and reward mean/std use %d training pairs", len(evals))
    collate = functools.partial(collate_pairs, pad_id=tok.pad_token_id)

    checkpointing = cfg.model.gradient_checkpointing_enable
    model = load_reward_model(
        cfg.model.model_name_or_path,
        tokenizer=tok,
        value_head_prefix=cfg.ds.value_head_prefix,  # the head's name, in the checkpoint and as saved
        **model_options(cfg.ds, checkpointing),
    )
    # --ds.lora.rank > 0: the adapters and the score head train
    model = apply_lora(model, cfg.ds.lora, gradient_checkpointing=checkpointing)
    engine, _ = make_train_engine(cfg, model, len(train), info.world_size)
    trainer = RMTrainer(cfg, engine, train, collate, evals)
    log.info(
        "RM: %d train / %d eval pairs, %d optimizer steps, grad accum %d",
        len(train),
        len(evals),
        trainer.total_steps,
        trainer.accum,
    )
    trainer.fit(trainer_checkpointer(cfg, trainer, tok, len(train)))
    # The statistics the saved config carries must come from the final weights.
    final = trainer.last_eval[1] if trainer.last_eval[0] == trainer.global_step else trainer.run_eval()
    E.save_hf(
        engine,
        tok,
        cfg.ckpt.output_dir,
        # the config already records value_head_prefix: the name the head is saved under
        config_updates={"mean": trainer.reward_mean, "std": trainer.reward_std},
    )
    log.info(
        "saved %s (reward mean %.4g, std %.4g, eval acc %.3f)",
        cfg.ckpt.output_dir,
        trainer.reward_mean,
        trainer.reward_std,
        final.get("acc", float("nan")),
    )
