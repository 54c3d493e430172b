"""Synthetic SFT, preference and prompt datasets where the right answer is known by
construction; written offline as jsonl, for tests, examples and the CPU demo chain.

The task is small-number addition ("What is 7 + 5?"), which the tiny model's tokenizer
covers digit by digit:

- SFT rows ``{"input", "output"}``: the answer as ``Answer: 12``;
- preference rows ``{"prompt", "chosen", "rejected", "margin", "kind"}``: chosen is always
  the correct ``Answer: N``; rejected is, by ``kind``, either ``format`` (a word salad with
  no answer, margin 1.0) or ``wrong`` (``Answer: M`` with M != N, margin 0.5). Format
  errors are learnable by a tiny model in seconds; arithmetic errors are not, so expect
  accuracy near 100% on ``format`` pairs and near chance on ``wrong`` ones;
- prompt rows ``{"input", "label"}`` for RL with an exact-match rule reward.

Run: ``python -m learner.supervised.synthetic_data OUT_DIR [--n_train 512 --n_eval 64 --seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

WORDS = (
    "apple banana cherry model token reward policy value learner rollout service python "
    "string number hello world the quick brown fox jumps over lazy dog"
).split()


def _question(rng: random.Random, max_operand: int):
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return f"What is {a} + {b}?", a + b


def sft_rows(n: int, seed: int, max_operand: int = 20) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        q, ans = _question(rng, max_operand)
        rows.append({"input": q, "output": f"Answer: {ans}"})
    return rows


def pair_rows(n: int, seed: int, max_operand: int = 20, format_frac: float = 0.5) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        q, ans = _question(rng, max_operand)
        if rng.random() < format_frac:
            rejected = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
            kind, margin = "format", 1.0
        else:
            wrong = ans + rng.choice([-3, -2, -1, 1, 2, 3])
            rejected, kind, margin = f"Answer: {abs(wrong)}", "wrong", 0.5
        rows.append({"prompt": q, "chosen": f"Answer: {ans}", "rejected": rejected, "margin": margin, "kind": kind})
    return rows


def prompt_rows(n: int, seed: int, max_operand: int = 20) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"input": q, "label": str(ans)} for q, ans in (_question(rng, max_operand) for _ in range(n))]


def write_jsonl(path: Path, rows: Sequence[Mapping[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_all(out_dir: str | Path, *, n_train: int = 512, n_eval: int = 64, seed: int = 0) -> dict[str, Path]:
    """Write every dataset; train and eval use different seeds (disjoint draws, not
    necessarily disjoint questions: there are only 441 of them)."""
    out = Path(out_dir)
    made = {}
    for name, fn in (("sft", sft_rows), ("pairs", pair_rows), ("prompts", prompt_rows)):
        made[f"{name}_train"] = write_jsonl(out / f"{name}_train.jsonl", fn(n_train, seed))
        made[f"{name}_eval"] = write_jsonl(out / f"{name}_eval.jsonl", fn(n_eval, seed + 10_000))
    return made


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m learner.supervised.synthetic_data", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", help="directory to write the jsonl files into")
    p.add_argument("--n_train", type=int, default=512, help="rows per training file")
    p.add_argument("--n_eval", type=int, default=64, help="rows per eval file")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws")
    args = p.parse_args(argv)
    for name, path in write_all(args.out_dir, n_train=args.n_train, n_eval=args.n_eval, seed=args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
