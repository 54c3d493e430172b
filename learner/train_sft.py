"""Supervised fine-tuning: next-token loss on response tokens only.

Run::

    torchrun --nproc_per_node N -m learner.train_sft --pretrain MODEL --dataset data.jsonl \
        --input_key question --output_key answer --apply_chat_template --save_path out/sft
    deepspeed --module learner.train_sft ...        # same flags
    python -m learner.train_sft ...                 # a world of one

Rows are prompt/response pairs (``--input_key``/``--output_key``) or, without
``--output_key``, whole chats (a list of messages in ``--input_key``: every assistant turn
is learned). ``--packing_samples`` packs each micro-batch into one row with attention kept
within each sample (position-id restarts; see ``learner.supervised.sft_data``). The final model is
saved in HF format to ``--save_path``.

Differences from OpenRLHF's ``train_sft``: the loss is normalised by the optimizer step's
global response-token count (OpenRLHF: per micro-batch); packing also works on CPU (SDPA
block-diagonal mask) without flash-attn; LoRA (``--lora_rank``) saves a merged model plus
``SAVE_PATH/adapter`` (docs/trainers.md); no ring attention or MoE aux loss yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from common.config import flag, parse
from learner.supervised.config import TrainerConfig


@dataclass
class SFTConfig(TrainerConfig):
    save_path: str = flag(
        "./ckpt/sft", "where the final HF-format model (and train_log.jsonl) are written", group="model"
    )
    input_key: str = flag("input", "column with the prompt (or the whole chat without --output_key)", group="data")
    output_key: str = flag("", "column with the response; empty: --input_key holds chat messages", group="data")
    input_template: str = flag(
        "User: {}\nAssistant: ", "template with one {} for the prompt when not using the chat template", group="data"
    )
    pretrain_mode: bool = flag(False, "loss on every token (continued pre-training), not just responses", group="data")
    packing_samples: bool = flag(
        False, "pack each micro-batch into one row, attention kept within samples", group="data"
    )
    max_epochs: int = flag(2, "passes over the training data", group="optim")


def main(argv: list[str] | None = None) -> None:
    cfg = parse(SFTConfig, argv, description=__doc__.split("\n")[0], prog="learner.train_sft")
    from learner.runtime.checkpoint import CheckpointError  # torch and DeepSpeed only after the flags parse
    from learner.supervised.sft_trainer import run

    try:
        run(cfg)
    except CheckpointError as e:  # damaged, or made with other settings: one line naming it
        raise SystemExit(f"learner.train_sft: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
