"""Prompt data for RL: ``common.datasets.load_prompts`` with train_ppo's flags, as PromptItems.

Errors name the file, row and key (``common.datasets.DataError``); ``--skip_bad_rows`` skips
and counts instead.
"""

from __future__ import annotations

import logging
from typing import Any

from learner.controller.controller import PromptItem
from learner.rl.config import PPOConfig

log = logging.getLogger(__name__)


def load_prompt_items(cfg: PPOConfig, tokenizer: Any, spec: str) -> list[PromptItem]:
    from common.datasets import load_prompts

    rows, skipped = load_prompts(
        spec,
        tokenizer,
        input_key=cfg.input_key,
        label_key=cfg.label_key or None,
        probs=(cfg.prompt_data_probs or None) if spec == cfg.prompt_data else None,
        split=cfg.prompt_split,
        max_samples=cfg.max_samples,
        seed=cfg.seed,
        apply_chat_template=cfg.apply_chat_template,
        input_template=cfg.input_template or None,
        prompt_max_len=cfg.prompt_max_len,
        skip_bad_rows=cfg.skip_bad_rows,
    )
    if skipped.total:
        log.warning("%s: %s", spec, skipped.report("prompts"))
    log.info("%s: %d prompts", spec, len(rows))
    return [PromptItem(tokens=r.input_ids, text=r.prompt, label=r.label) for r in rows]
