"""Reward-model training on preference pairs (Bradley-Terry), saved as an HF sequence classifier.

Run::

    torchrun --nproc_per_node N -m learner.train_rm --pretrain SFT_MODEL --dataset pairs.jsonl \
        --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template \
        --save_path out/rm

The model is the causal LM with a scalar head (``AutoModelForSequenceClassification``,
``num_labels=1``; a new head starts near zero), reading the reward at the last token of
``prompt + response``, which always ends in EOS. Loss ``--loss sigmoid`` or ``logexp``, with
``--margin_loss`` a per-pair margin from ``--margin_key``. Evaluation reports accuracy (chosen
scored above rejected) and the reward mean/std over the eval set (or, without
``--eval_dataset``, over 1% of the training rows, as OpenRLHF does); the final save writes
them into ``config.json`` as ``mean`` and ``std`` so ``--normalize_reward`` works in the
reward service.

Differences from OpenRLHF's ``train_rm``: the saved model is a plain transformers sequence
classifier (OpenRLHF saves a custom class and needs its loader), head name ``score``;
LoRA with ``--lora_rank`` (the score head trains in full); no packing or ring attention yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from common.config import flag, parse
from learner.supervised.config import TrainerConfig


@dataclass
class RMConfig(TrainerConfig):
    save_path: str = flag(
        "./ckpt/rm", "where the final HF-format reward model (and train_log.jsonl) are written", group="model"
    )
    prompt_key: str = flag("", "column with the prompt; empty: chosen/rejected hold whole texts or chats", group="data")
    chosen_key: str = flag("chosen", "column with the preferred response", group="data")
    rejected_key: str = flag("rejected", "column with the dispreferred response", group="data")
    margin_key: str = flag("margin", "column with a per-pair margin (used with --margin_loss)", group="data")
    max_len: int = flag(512, "max tokens per sequence; longer ones are cut and end in EOS", group="data")
    loss: str = flag("sigmoid", "pairwise loss", choices=("sigmoid", "logexp"), group="optim")
    margin_loss: bool = flag(False, "subtract the --margin_key margin inside the loss (Llama 2)", group="optim")
    learning_rate: float = flag(9e-6, "peak learning rate", group="optim")
    value_head_prefix: str = flag(
        "score", "name of the scalar head (transformers' classifiers use 'score')", choices=("score",), group="model"
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse(RMConfig, argv, description=__doc__.split("\n")[0], prog="learner.train_rm")
    from learner.runtime.checkpoint import CheckpointError  # torch and DeepSpeed only after the flags parse
    from learner.supervised.rm_trainer import run

    try:
        run(cfg)
    except CheckpointError as e:  # damaged, or made with other settings: one line naming it
        raise SystemExit(f"learner.train_rm: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
