"""Reward-model training on preference pairs (Bradley-Terry), saved as an HF sequence classifier.

Run::

    torchrun --nproc_per_node N -m learner.train_rm --model.model_name_or_path SFT_MODEL \
        --data.dataset pairs.jsonl --data.prompt_key prompt --data.chosen_key chosen \
        --data.rejected_key rejected --data.apply_chat_template --ckpt.output_dir out/rm
    torchrun ... -m learner.train_rm --pretrain SFT_MODEL --dataset pairs.jsonl ... --save_path out/rm

Flags are OpenRLHF 0.10's dotted names or the older flat ones, mixed freely
(``learner.supervised.config``). The model is the causal LM with a scalar head
(``AutoModelForSequenceClassification``, ``num_labels=1``; a new head starts near zero),
reading the reward at the last token of ``prompt + response``, which always ends in EOS. Loss
``--model.loss_type sigmoid`` or ``logexp`` (``--loss``), computed in fp32, with
``--model.margin_loss_enable`` (``--margin_loss``) a per-pair margin from ``--data.margin_key``.
Evaluation reports accuracy (chosen scored above rejected) and the reward mean/std over the
eval set (or, without ``--eval.dataset``, over 1% of the training rows, as OpenRLHF does); the
final save writes them into ``config.json`` as ``mean`` and ``std`` so ``--normalize_reward``
works in the reward service.

Differences from OpenRLHF's ``train_rm``: the saved model is a plain transformers sequence
classifier (OpenRLHF saves a custom class and needs its loader), head name ``score``;
LoRA with ``--ds.lora.rank`` (the score head trains in full); no packing or ring attention yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.config import flag, parse, section
from learner.runtime.flags import AdamSection
from learner.supervised.config import (
    ADAM_FLAT,
    ModelSection,
    PairDataSection,
    SupervisedCkptSection,
    TrainerConfig,
)


@dataclass
class RMModelSection(ModelSection):
    """The reward model and its pairwise loss."""

    loss_type: str = flag("sigmoid", "pairwise loss", choices=("sigmoid", "logexp"), flat="loss")
    margin_loss_enable: bool = flag(
        False, "subtract the --data.margin_key margin inside the loss (Llama 2)", flat="margin_loss"
    )
    compute_fp32_loss_enable: bool = flag(
        True,
        "compute the loss in fp32",
        flat="compute_fp32_loss",
        inert="rayless always computes the reward-model loss in fp32 (learner.algorithms.rm_loss)",
    )


@dataclass
class RMDataSection(PairDataSection):
    """Preference pairs, with an optional per-pair margin."""

    margin_key: str = flag(
        "margin", "column with a per-pair margin (used with --model.margin_loss_enable)", flat="margin_key"
    )

    def keys(self, margin: bool = False) -> list[str]:
        return super().keys() + ([self.margin_key] if margin else [])


@dataclass
class RMConfig(TrainerConfig):
    """Every flag of ``learner.train_rm``, by section."""

    value_head: ClassVar[bool] = True
    adam: AdamSection = section(AdamSection, "AdamW", flat=ADAM_FLAT, defaults={"lr": 9e-6})
    model: RMModelSection = section(RMModelSection, "the reward model")
    data: RMDataSection = section(RMDataSection, "the preference pairs", defaults={"max_len": 512})
    ckpt: SupervisedCkptSection = section(
        SupervisedCkptSection, "checkpoints and the final reward model", defaults={"output_dir": "./ckpt/rm"}
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
    main()
