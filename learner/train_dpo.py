"""Direct preference optimisation (DPO, cDPO, IPO) against a frozen reference model.

Run::

    torchrun --nproc_per_node N -m learner.train_dpo --pretrain SFT_MODEL --dataset pairs.jsonl \
        --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template \
        --beta 0.1 --save_path out/dpo

The reference model (``--ref_pretrain``, default ``--pretrain``) lives in the same process as
an inference-only DeepSpeed engine; ``--ref_offload`` keeps its parameters in CPU memory
(DeepSpeed ZeRO-3 parameter offload). Logged: the loss, implicit chosen/rejected rewards
``beta * log(pi/ref)``, their margin and the preference accuracy, on train and eval data.

Differences from OpenRLHF's ``train_dpo``: losses are pure functions in
``learner.algorithms.dpo_loss``; LoRA with ``--lora_rank`` (docs/trainers.md); no packing yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from common.config import flag, parse
from learner.supervised.config import TrainerConfig


@dataclass
class DPOConfig(TrainerConfig):
    save_path: str = flag(
        "./ckpt/dpo", "where the final HF-format model (and train_log.jsonl) are written", group="model"
    )
    ref_pretrain: str = flag("", "reference model (default: --pretrain)", group="model")
    ref_offload: bool = flag(
        False, "keep the reference model's parameters in CPU memory (ZeRO-3 offload)", group="deepspeed"
    )
    prompt_key: str = flag("", "column with the prompt; empty: chosen/rejected hold whole chats", group="data")
    chosen_key: str = flag("chosen", "column with the preferred response", group="data")
    rejected_key: str = flag("rejected", "column with the dispreferred response", group="data")
    input_template: str = flag(
        "User: {}\nAssistant: ", "template with one {} for the prompt when not using the chat template", group="data"
    )
    max_len: int = flag(512, "max tokens per sequence; longer ones are truncated", group="data")
    beta: float = flag(0.1, "DPO beta: strength of the KL anchor to the reference (IPO's tau)", group="optim")
    label_smoothing: float = flag(0.0, "cDPO: assumed probability that a preference label is flipped", group="optim")
    ipo: bool = flag(False, "use the IPO loss instead of DPO", group="optim")
    nll_loss_coef: float = flag(0.0, "weight of the per-token NLL of the chosen response (RPO)", group="optim")
    learning_rate: float = flag(1e-5, "peak learning rate", group="optim")


def main(argv: list[str] | None = None) -> None:
    cfg = parse(DPOConfig, argv, description=__doc__.split("\n")[0], prog="learner.train_dpo")
    from learner.runtime.checkpoint import CheckpointError  # torch and DeepSpeed only after the flags parse
    from learner.supervised.dpo_trainer import run

    try:
        run(cfg)
    except CheckpointError as e:  # damaged, or made with other settings: one line naming it
        raise SystemExit(f"learner.train_dpo: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
