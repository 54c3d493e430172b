"""Training and prompt data through Hugging Face ``datasets``: loading, mixing, row checks,
and rendering rows into model text (chat template or ``--input_template``).

Where data comes from (``--dataset``, comma-separated for several sources):

- a local file: ``.json``, ``.jsonl``, ``.parquet``, ``.csv``, ``.arrow``;
- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
- a directory of such files (all of one format), loaded as one dataset;
- otherwise a hub name (``org/name``), which needs network access or a warm HF cache
  (clusters; never in CI here).

Several sources mix by ``--dataset_probs`` (seeded interleaving that stops when every
source is exhausted, so small sources are oversampled) or, without probabilities, are
concatenated. ``--max_samples`` caps each source before mixing (as OpenRLHF does).

Every row keeps where it came from in two columns, ``_source`` (file or name) and ``_row``
(index in that source), so later checks (an over-long prompt) can name them. A row with a
missing or empty required key is an error naming source, row and key, or, with
``skip_bad_rows``, is dropped and counted.

This module imports ``datasets`` lazily: trainers' ``--help`` stays fast.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DataError",
    "FILE_FORMATS",
    "parse_probs",
    "load_source",
    "load_mixed",
    "check_rows",
    "SkipCounter",
    "to_messages",
    "render_prompt",
    "render_response",
    "end_with_eos",
    "PromptRow",
    "DEFAULT_DATASOURCE",
    "datasource_names",
    "prompt_rows",
    "load_prompts",
]

log = logging.getLogger("rayless.datasets")

# file suffix -> `datasets.load_dataset` builder name
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
SOURCE_COL, ROW_COL = "_source", "_row"


class DataError(ValueError):
    """A dataset cannot be used as asked: bad path, missing key, empty value, over-long row."""


@dataclass
class SkipCounter:
    """Rows dropped under ``skip_bad_rows``, by reason; logged once at the end of loading."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> first offending row

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.examples.setdefault(reason, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self, what: str = "rows") -> str:
        if not self.counts:
            return f"no {what} skipped"
        parts = [f"{n} {reason} (first: {self.examples[reason]})" for reason, n in self.counts.items()]
        return f"skipped {self.total} {what}: " + "; ".join(parts)


# --------------------------------------------------------------------------- loading


def parse_probs(probs: str | None, n_sources: int) -> list[float] | None:
    """``"0.7,0.3"`` -> [0.7, 0.3] (normalised); None/"" -> None. Counts must match sources."""
    if probs is None or str(probs).strip() == "":
        return None
    values = [float(p) for p in str(probs).split(",")]
    if n_sources == 1 and len(values) == 1:
        return None  # OpenRLHF's default "1.0" with one dataset: nothing to mix
    if len(values) != n_sources:
        raise DataError(f"--dataset_probs has {len(values)} values for {n_sources} datasets")
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise DataError(f"--dataset_probs must be non-negative with a positive sum, got {probs}")
    total = sum(values)
    return [v / total for v in values]


def _pick_split(loaded: Any, split: str, where: str):
    from datasets import DatasetDict

    if isinstance(loaded, DatasetDict):
        if split not in loaded:
            raise DataError(f"{where}: no split {split!r}; it has {sorted(loaded)}")
        return loaded[split]
    return loaded


def load_source(source: str, *, split: str = "train"):
    """One ``datasets.Dataset`` from a file, a saved dataset dir, a folder of files or a hub name."""
    import datasets

    path = Path(source).expanduser()
    if path.is_file():
        fmt = FILE_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(f"{source}: unknown file type {path.suffix!r}; use one of {sorted(FILE_FORMATS)}")
        # A local file is all one split, whatever --dataset_split says.
        return datasets.load_dataset(fmt, data_files=str(path), split="train")
    if path.is_dir():
        if (
            (path / "dataset_info.json").is_file()
            or (path / "dataset_dict.json").is_file()
            or (path / "state.json").is_file()
        ):
            return _pick_split(datasets.load_from_disk(str(path)), split, source)
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in FILE_FORMATS and p.is_file())
        formats = {FILE_FORMATS[p.suffix.lower()] for p in files}
        if not files:
            raise DataError(
                f"{source}: a directory with no data files ({', '.join(sorted(FILE_FORMATS))}) and not a saved dataset"
            )
        if len(formats) > 1:
            raise DataError(
                f"{source}: mixes file formats {sorted(formats)}; give the files as a comma-separated --dataset instead"
            )
        return datasets.load_dataset(formats.pop(), data_files=[str(p) for p in files], split="train")
    # A hub name is "name" or "org/name"; anything path-like that does not exist is a typo.
    if source.startswith((".", "/", "~")) or source.count("/") > 1 or path.suffix.lower() in FILE_FORMATS:
        raise DataError(f"{source}: no such file or directory")
    try:
        return _pick_split(datasets.load_dataset(source, split=split), split, source)
    except Exception as e:  # offline, unknown name, gated: say what we tried
        raise DataError(
            f"{source}: not a local file or directory, and loading it as a hub dataset "
            f"(split {split!r}) failed: {type(e).__name__}: {e}"
        ) from e


def check_rows(
    ds,
    keys: Sequence[str],
    source: str,
    *,
    skip_bad_rows: bool,
    skipped: SkipCounter | None = None,
    allow_empty: Sequence[str] = (),
):
    """Rows whose ``keys`` are present and non-empty; else DataError naming source, row and key.

    Empty means None, "", or an empty list (e.g. no chat messages). ``allow_empty`` keys
    must exist as columns but may hold empty values (an empty system prompt).
    """
    missing_cols = [k for k in keys if k not in ds.column_names]
    if missing_cols:
        raise DataError(
            f"{source}: no column {missing_cols[0]!r} (row 0); it has columns "
            f"{[c for c in ds.column_names if not c.startswith('_')]}. Set the key flag "
            "(--input_key, --chosen_key, ...) to one of them"
        )
    bad: list[int] = []
    for key in keys:
        if key in allow_empty:
            continue
        for i, value in enumerate(ds[key]):
            if value is None or (isinstance(value, (str, list)) and len(value) == 0):
                where = f"{source}, row {i}, key {key!r}"
                if not skip_bad_rows:
                    raise DataError(f"{where}: missing or empty (pass --skip_bad_rows to skip such rows)")
                if skipped is not None:
                    skipped.add(f"missing/empty {key!r}", where)
                bad.append(i)
    if bad:
        drop = set(bad)
        ds = ds.select([i for i in range(len(ds)) if i not in drop])
    return ds


def load_mixed(
    dataset: str,
    *,
    probs: str | None = None,
    split: str = "train",
    max_samples: int | None = None,
    seed: int = 42,
    required_keys: Sequence[str] = (),
    allow_empty: Sequence[str] = (),
    skip_bad_rows: bool = False,
    skipped: SkipCounter | None = None,
):
    """Load comma-separated sources, check ``required_keys``, cap, and mix into one Dataset.

    Adds the ``_source``/``_row`` columns (see module docstring). ``skipped`` collects the
    count of dropped rows when ``skip_bad_rows``; the caller logs ``skipped.report()``.
    """
    from datasets import concatenate_datasets, interleave_datasets

    sources = [s.strip() for s in str(dataset).split(",") if s.strip()]
    if not sources:
        raise DataError("--dataset is empty")
    weights = parse_probs(probs, len(sources))
    parts = []
    for source in sources:
        ds = load_source(source, split=split)
        ds = ds.add_column(SOURCE_COL, [source] * len(ds)).add_column(ROW_COL, list(range(len(ds))))
        ds = check_rows(
            ds, required_keys, source, skip_bad_rows=skip_bad_rows, skipped=skipped, allow_empty=allow_empty
        )
        if max_samples is not None and max_samples >= 0:
            ds = ds.select(range(min(int(max_samples), len(ds))))
        if len(ds) == 0:
            raise DataError(f"{source}: no usable rows (after checks and --max_samples)")
        parts.append(ds)
    if len(parts) == 1:
        return parts[0]
    # Sources may carry different extra columns; keep the common ones so they can be joined.
    common = set.intersection(*(set(p.column_names) for p in parts))
    parts = [p.remove_columns([c for c in p.column_names if c not in common]) for p in parts]
    if weights is None:
        return concatenate_datasets(parts)
    return interleave_datasets(parts, probabilities=weights, seed=seed, stopping_strategy="all_exhausted")


# --------------------------------------------------------------------------- rendering text


def to_messages(value: Any, role: str) -> list[dict[str, str]]:
    """A chat-message list from a string (one message with ``role``) or a message list (as is)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict) and "content" in value:
        return [dict(value)]
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in value):
        return [dict(m) for m in value]
    raise DataError(f"expected a string or a list of {{role, content}} messages, got {type(value).__name__}")


def render_prompt(
    value: Any, tokenizer: Any = None, *, apply_chat_template: bool = False, input_template: str | None = None
) -> str:
    """The prompt text a model sees: chat template with a generation prompt, else
    ``input_template.format(value)`` (one ``{}``), else the string itself."""
    if apply_chat_template:
        return tokenizer.apply_chat_template(to_messages(value, "user"), tokenize=False, add_generation_prompt=True)
    if not isinstance(value, str):
        raise DataError("a chat-message prompt needs --apply_chat_template")
    if input_template:
        return input_template.format(value)
    return value


def end_with_eos(text: str, eos: str | None) -> str:
    """``text`` ending in exactly one EOS: trailing whitespace after a final EOS is dropped
    (ChatML renders ``<|im_end|>\\n``) so the sequence ends where generation stops."""
    if not eos:
        return text
    stripped = text.rstrip()
    return stripped if stripped.endswith(eos) else text + eos


def render_response(
    prompt_value: Any,
    response_value: Any,
    tokenizer: Any,
    *,
    apply_chat_template: bool = False,
    input_template: str | None = None,
) -> tuple[str, str]:
    """``(prompt_text, response_text)`` with ``prompt_text + response_text`` the full sequence,
    ending in the tokenizer's EOS; the response is what a loss is taken on.

    ``prompt_value`` may be None (the response value then holds the whole conversation, as
    in chat-format preference data: the prompt is every message before the last).
    """
    eos = getattr(tokenizer, "eos_token", None)
    if apply_chat_template:
        if prompt_value is None:
            messages = to_messages(response_value, "assistant")
            prompt_msgs, reply = messages[:-1], messages[-1:]
        else:
            prompt_msgs, reply = to_messages(prompt_value, "user"), to_messages(response_value, "assistant")
        prompt = (
            tokenizer.apply_chat_template(prompt_msgs, tokenize=False, add_generation_prompt=True)
            if prompt_msgs
            else ""
        )
        full = tokenizer.apply_chat_template(prompt_msgs + reply, tokenize=False)
        if not full.startswith(prompt):
            raise DataError(
                "the chat template does not render the prompt as a prefix of the conversation; "
                "cannot tell response tokens apart"
            )
        return prompt, end_with_eos(full[len(prompt) :], eos)
    if not isinstance(response_value, str) or (prompt_value is not None and not isinstance(prompt_value, str)):
        raise DataError("chat-message rows need --apply_chat_template")
    prompt = render_prompt(prompt_value, input_template=input_template) if prompt_value is not None else ""
    return prompt, end_with_eos(response_value, eos)


# --------------------------------------------------------------------------- prompts (RL)


@dataclass(frozen=True)
class PromptRow:
    """One RL prompt: the rendered text, its token ids, the label for reward functions."""

    prompt: str
    input_ids: list[int]
    label: Any
    source: str
    row: int
    datasource: str = ""  # the data source its evaluation metrics are reported under (``datasource_key``)


DEFAULT_DATASOURCE = "default"  # OpenRLHF's name for rows without a data source


def datasource_names(ds, key: str | None, sources: Sequence[str]) -> list[str]:
    """Each row's data source: its ``key`` column when it has a value; else the name of the
    file it came from when there are several, else ``"default"`` (as OpenRLHF)."""
    values = ds[key] if key and key in ds.column_names else [None] * len(ds)
    several = len(set(sources)) > 1
    return [
        str(v) if v not in (None, "") else (Path(src).stem if several else DEFAULT_DATASOURCE)
        for v, src in zip(values, sources, strict=True)
    ]


def prompt_rows(
    ds,
    tokenizer: Any,
    *,
    input_key: str,
    label_key: str | None = None,
    apply_chat_template: bool = False,
    input_template: str | None = None,
    prompt_max_len: int | None = None,
    skip_bad_rows: bool = False,
    skipped: SkipCounter | None = None,
    datasource_key: str | None = None,
) -> list[PromptRow]:
    """Render and tokenize prompts (from ``load_mixed``); over-long ones raise or are skipped.

    Token ids are what the chat template or template renders, without extra special tokens
    (the template already has them), so they are exactly what the rollout engine gets. Each
    row's ``datasource`` is named by ``datasource_names``.
    """
    sources = ds[SOURCE_COL] if SOURCE_COL in ds.column_names else ["<dataset>"] * len(ds)
    datasources = datasource_names(ds, datasource_key, sources)
    rows_idx = ds[ROW_COL] if ROW_COL in ds.column_names else list(range(len(ds)))
    labels = ds[label_key] if label_key else [None] * len(ds)
    texts = [
        render_prompt(v, tokenizer, apply_chat_template=apply_chat_template, input_template=input_template)
        for v in ds[input_key]
    ]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out: list[PromptRow] = []
    for text, tok, label, src, r, dsrc in zip(texts, ids, labels, sources, rows_idx, datasources, strict=True):
        if prompt_max_len and len(tok) > prompt_max_len:
            where = f"{src}, row {r}, key {input_key!r}"
            if not skip_bad_rows:
                raise DataError(
                    f"{where}: prompt is {len(tok)} tokens, over --prompt_max_len "
                    f"{prompt_max_len} (pass --skip_bad_rows to skip such rows)"
                )
            if skipped is not None:
                skipped.add("over --prompt_max_len", where)
            continue
        out.append(PromptRow(text, list(tok), label, src, int(r), dsrc))
    return out


def load_prompts(
    prompt_data: str,
    tokenizer: Any,
    *,
    input_key: str,
    label_key: str | None = None,
    probs: str | None = None,
    split: str = "train",
    max_samples: int | None = None,
    seed: int = 42,
    apply_chat_template: bool = False,
    input_template: str | None = None,
    prompt_max_len: int | None = None,
    skip_bad_rows: bool = False,
    datasource_key: str | None = None,
) -> tuple[list[PromptRow], SkipCounter]:
    """``load_mixed`` + ``prompt_rows`` in one call (the PPO controller's prompt data).

    Returns the rows and what was skipped (log ``skipped.report("prompts")``).
    """
    skipped = SkipCounter()
    keys = [input_key] + ([label_key] if label_key else [])
    ds = load_mixed(
        prompt_data,
        probs=probs,
        split=split,
        max_samples=max_samples,
        seed=seed,
        required_keys=keys,
        skip_bad_rows=skip_bad_rows,
        skipped=skipped,
    )
    rows = prompt_rows(
        ds,
        tokenizer,
        input_key=input_key,
        label_key=label_key,
        apply_chat_template=apply_chat_template,
        input_template=input_template,
        prompt_max_len=prompt_max_len,
        skip_bad_rows=skip_bad_rows,
        skipped=skipped,
        datasource_key=datasource_key,
    )
    if not rows:
        raise DataError(f"{prompt_data}: no usable prompts ({skipped.report('prompts')})")
    return rows, skipped
