"""Direct preference optimisation (DPO, cDPO, IPO) against a frozen reference model.

Run::

    torchrun --nproc_per_node N -m learner.train_dpo --model.model_name_or_path SFT_MODEL \
        --data.dataset pairs.jsonl --data.prompt_key prompt --data.chosen_key chosen \
        --data.rejected_key rejected --data.apply_chat_template --model.beta 0.1 \
        --ckpt.output_dir out/dpo
    torchrun ... -m learner.train_dpo --pretrain SFT_MODEL --dataset pairs.jsonl ... --beta 0.1

Flags are OpenRLHF 0.10's dotted names or the older flat ones, mixed freely
(``learner.supervised.config``). The reference model (``--ref.model_name_or_path`` /
``--ref_pretrain``, default the trained model's) lives in the same process as an
inference-only DeepSpeed engine; ``--ref.offload`` (``--ref_offload``) keeps its parameters in
CPU memory (DeepSpeed ZeRO-3 parameter offload). Logged: the loss, implicit chosen/rejected
rewards ``beta * log(pi/ref)``, their margin and the preference accuracy, on train and eval data.

Differences from OpenRLHF's ``train_dpo``: losses are pure functions in
``learner.algorithms.dpo_loss``; LoRA with ``--ds.lora.rank`` (docs/trainers.md); no packing yet;
``--eval.split`` defaults to ``train`` as in the other trainers (OpenRLHF's DPO: ``test``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
class DPOModelSection(ModelSection):
    """The trained policy and the DPO loss."""

    beta: float = flag(0.1, "DPO beta: strength of the KL anchor to the reference (IPO's tau)", flat="beta")
    ipo_enable: bool = flag(False, "use the IPO loss instead of DPO", flat="ipo")
    label_smoothing: float = flag(
        0.0, "cDPO: assumed probability that a preference label is flipped", flat="label_smoothing"
    )
    nll_loss_coef: float = flag(0.0, "weight of the per-token NLL of the chosen response (RPO)", flat="nll_loss_coef")

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"--model.beta (--beta) must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(
                f"--model.label_smoothing (--label_smoothing) must be in [0, 0.5), got {self.label_smoothing}"
            )
        if self.nll_loss_coef < 0:
            raise ValueError(f"--model.nll_loss_coef (--nll_loss_coef) must be >= 0, got {self.nll_loss_coef}")


@dataclass
class RefSection:
    """The frozen reference model, in this process."""

    model_name_or_path: str = flag("", "reference model (default: --model.model_name_or_path)", flat="ref_pretrain")
    offload: bool = flag(
        False, "keep the reference model's parameters in CPU memory (ZeRO-3 offload)", flat="ref_offload"
    )


@dataclass
class DPOConfig(TrainerConfig):
    """Every flag of ``learner.train_dpo``, by section."""

    adam: AdamSection = section(AdamSection, "AdamW", flat=ADAM_FLAT, defaults={"lr": 1e-5})
    model: DPOModelSection = section(DPOModelSection, "the trained policy and the DPO loss")
    ref: RefSection = section(RefSection, "the reference model")
    data: PairDataSection = section(
        PairDataSection,
        "the preference pairs",
        defaults={"input_template": "User: {}\nAssistant: ", "max_len": 512},
    )
    ckpt: SupervisedCkptSection = section(
        SupervisedCkptSection, "checkpoints and the final model", defaults={"output_dir": "./ckpt/dpo"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # As OpenRLHF: no reference given is the starting model (the logged config says which).
        if not self.ref.model_name_or_path:
            self.ref.model_name_or_path = self.model.model_name_or_path


def main(argv: list[str] | None = None) -> None:
    cfg = parse(DPOConfig, argv, description=__doc__.split("\n")[0], prog="learner.train_dpo")
    from learner.runtime.checkpoint import CheckpointError  # torch and DeepSpeed only after the flags parse
    from learner.supervised.dpo_trainer import run

    try:
        run(cfg)
    except CheckpointError as e:  # damaged, or made with other settings: one line naming it
        raise SystemExit(f"learner.train_dpo: {e}") from None


if __name__ == "__main__":
    main()
