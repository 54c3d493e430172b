"""Prompt data for RL: ``common.datasets.load_prompts`` with train_ppo's flags, as PromptItems,
and the order a run draws them in (``PromptStream``).

Errors name the file, row and key (``common.datasets.DataError``); ``--skip_bad_rows`` skips
and counts instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from common.protocol import SEED_LIMIT
from learner.controller.types import PromptItem
from learner.rl.config import PPOConfig

log = logging.getLogger(__name__)


def load_prompt_items(cfg: PPOConfig, tokenizer: Any, spec: str, *, evaluation: bool = False) -> list[PromptItem]:
    """The prompts of ``spec``: --prompt_data's (its split and mixing probabilities), or with
    ``evaluation`` --eval_dataset's (its split; each item names its data source).

    ``--max_samples`` N as OpenRLHF's ``prepare_datasets``: the training prompts are the first N
    of each source, mixed, and then the first N of the mix; the evaluation prompts are the first
    N of all sources one after another (so a large first source can leave later ones out)."""
    from common.datasets import load_prompts

    rows, skipped = load_prompts(
        spec,
        tokenizer,
        input_key=cfg.data.input_key,
        label_key=cfg.data.label_key or None,
        probs=None if evaluation else (cfg.data.prompt_probs or None),
        split=cfg.eval.split if evaluation else cfg.data.prompt_split,
        max_samples=None if evaluation else cfg.data.max_samples,
        seed=cfg.train.seed,
        apply_chat_template=cfg.data.apply_chat_template,
        input_template=cfg.data.input_template or None,
        prompt_max_len=cfg.data.prompt_max_len,
        skip_bad_rows=cfg.data.skip_bad_rows,
        datasource_key=(cfg.eval.datasource_key or None) if evaluation else None,
    )
    if skipped.total:
        log.warning("%s: %s", spec, skipped.report("prompts"))
    if len(rows) > cfg.data.max_samples:
        log.info("%s: the first %d of %d prompts (--max_samples)", spec, cfg.data.max_samples, len(rows))
        rows = rows[: cfg.data.max_samples]
    log.info("%s: %d prompts", spec, len(rows))
    return [PromptItem(tokens=r.input_ids, text=r.prompt, label=r.label, source=r.datasource) for r in rows]


def sampling_seed(base: int, *key: object) -> int:
    """A prompt's sampling seed (``PromptItem.seed``) from the run's ``--seed`` and the prompt's
    place in the run: a hash, so that seeds of different places are unrelated (vLLM samples a
    prompt's n samples with seed .. seed + n-1: consecutive integers would overlap)."""
    digest = hashlib.blake2b(repr((base, *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


class PromptStream:
    """The training prompts in the order a run draws them: step s takes the ``batch_size``
    prompts after step s-1's, episode after episode (the same slices every episode);
    dynamic-filtering refills draw the prompts that follow the step's batch, cycling.

    With ``seed`` (``--seed_sampling``) every prompt drawn carries its sampling seed: the
    prompt at stream position p ``sampling_seed(seed, p)``, the j-th refill of step s
    ``sampling_seed(seed, "refill", s, j)`` -- places, not prompt ids, so that a learner
    restarted from a checkpoint draws each place with the seed the killed one used."""

    def __init__(self, items: list[PromptItem], batch_size: int, seed: int | None = None) -> None:
        if len(items) < batch_size:
            raise ValueError(f"{len(items)} prompts, fewer than one batch of {batch_size}")
        self.items = items
        self.batch_size = batch_size
        self.steps_per_episode = len(items) // batch_size
        self.seed = seed

    def _seeded(self, item: PromptItem, *key: object) -> PromptItem:
        return item if self.seed is None else dataclasses.replace(item, seed=sampling_seed(self.seed, *key))

    def batch(self, step: int) -> list[PromptItem]:
        """The prompts of ``step`` (1-based): stream positions (step-1)*B .. step*B - 1."""
        return [self.at((step - 1) * self.batch_size + i) for i in range(self.batch_size)]

    def at(self, position: int) -> PromptItem:
        """The prompt at ``position`` (0-based) of the endless sequence batch(1), batch(2), ...:
        how the async schedule's checkpoints name prompts (controller prompt ids restart at 0
        in a new learner process; positions do not)."""
        step, i = divmod(position, self.batch_size)  # batch(step + 1)[i]
        return self._seeded(self.items[(step % self.steps_per_episode) * self.batch_size + i], position)

    def stream(self, position: int) -> Iterator[PromptItem]:
        """The prompts from ``position`` on, without end (``at(position)``, ``at(position + 1)``, ...)."""
        while True:
            yield self.at(position)
            position += 1

    def state_dict(self) -> dict[str, Any]:
        """What pins the stream down. Its position needs no saving: step s draws ``batch(s)``
        and ``refills(s)`` whatever came before, so a run resumed after step k draws from step
        k+1 exactly what the uninterrupted run drew. Saved to refuse a resume on other data."""
        return {
            "batch_size": self.batch_size,
            "n_items": len(self.items),
            "fingerprint": fingerprint(it.tokens for it in self.items),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        diffs = [f"{k} {state[k]} (now {mine[k]})" for k in mine if k in state and state[k] != mine[k]]
        if diffs:
            raise ValueError(
                f"the checkpoint's prompt stream differs from this run's: {', '.join(diffs)}; "
                "the data file, its order (--seed) or the filters changed"
            )

    def refills(self, step: int) -> Callable[[int], list[PromptItem]]:
        """``more(k)``: the next k prompts after ``step``'s batch, cycling through the data."""
        offset = ((step - 1) % self.steps_per_episode) * self.batch_size + self.batch_size
        following = enumerate(itertools.islice(itertools.cycle(self.items), offset, None))
        return lambda k: [self._seeded(item, "refill", step, j) for j, item in itertools.islice(following, k)]


def fingerprint(prompts: Iterable[list[int]]) -> int:
    """crc32 of prompts' token ids in order: equal for two sequences of the same prompts."""
    crc = 0
    for tokens in prompts:
        crc = zlib.crc32(repr(list(tokens)).encode(), crc)
    return crc
