"""Whether two checkpoints read token ids alike: a teacher scores the student's sampled ids.

On-policy distillation (docs/distillation.md) compares the teacher's log-probs with the student's
at the same token ids, so the two must share one tokenizer: the same id for every token string
and the same special tokens. The models' embedding tables may be padded to different sizes
(Qwen2.5's 0.5B and 7B: 151936 and 152064 rows for one tokenizer of 151665 ids); what matters is
that the teacher's holds every id the tokenizer can produce. Loads tokenizers and configs only
(no weights). Used by the learner at start-up (``--teacher_pretrain`` against ``--pretrain``) and
by a reward service started with ``--teacher_pretrain`` and the policy's ``--tokenizer``.
"""

from __future__ import annotations

from typing import Any


def _vocab(path: str) -> tuple[dict[str, int], dict[str, Any]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    specials = {name: getattr(tok, f"{name}_token_id", None) for name in ("eos", "bos", "pad", "unk")}
    return tok.get_vocab(), specials


def _embedding_rows(path: str) -> int | None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    text = getattr(cfg, "text_config", None) or cfg  # a multimodal config keeps the LM's under text_config
    rows = getattr(text, "vocab_size", None)
    return int(rows) if rows else None


def check_same_tokenizer(
    student: str, teacher: str, *, student_flag: str = "--pretrain", teacher_flag: str = "--teacher_pretrain"
) -> None:
    """Raises ValueError naming both paths when ``teacher`` does not tokenize as ``student``.

    Same tokenizer: the same token -> id map and the same eos/bos/pad/unk ids; and the teacher's
    embedding (its config's ``vocab_size``) at least as large as that map, so every sampled id is
    one of its rows.
    """
    if student == teacher:
        return
    s_vocab, s_special = _vocab(student)
    t_vocab, t_special = _vocab(teacher)
    if s_vocab != t_vocab:
        differ = sorted(k for k in s_vocab.keys() | t_vocab.keys() if s_vocab.get(k) != t_vocab.get(k))
        raise ValueError(
            f"the teacher {teacher_flag} {teacher} does not share the student's tokenizer ({student_flag} {student}): "
            f"{len(s_vocab)} and {len(t_vocab)} tokens, {len(differ)} with different ids (e.g. {differ[:3]}); "
            "on-policy distillation compares log-probs of the same token ids: use a teacher of the same family"
        )
    if s_special != t_special:
        raise ValueError(
            f"the teacher {teacher_flag} {teacher} and the student {student_flag} {student} share their tokens but "
            f"not their special ids ({t_special} against {s_special})"
        )
    rows, needed = _embedding_rows(teacher), max(s_vocab.values(), default=-1) + 1
    if rows is not None and rows < needed:
        raise ValueError(
            f"the teacher {teacher_flag} {teacher} has {rows} embedding rows, fewer than the {needed} ids of the "
            f"student's tokenizer ({student_flag} {student})"
        )
