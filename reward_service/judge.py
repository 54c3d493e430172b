"""Generative reward: a judge model behind an OpenAI-compatible URL scores each sample.

    python -m reward_service --controller ... --judge_url http://judge:8000/v1 --judge_model Qwen/Qwen2.5-7B-Instruct \\
        --judge_prompt examples/judges/correctness.txt --judge_parser score --judge_score_scale 10

Each sample becomes one chat request (``POST URL/chat/completions``, a single user message): the
template file with ``{prompt}``, ``{response}`` and ``{label}`` replaced by the sample's text (only
those three: any other brace, a LaTeX ``\\frac{1}{2}``, stays as written). A batch's requests go out
at once, ``--judge_concurrency`` in flight. The reply's text becomes a number by ``--judge_parser``
(``PARSERS``), divided by ``--judge_score_scale``. A request that fails after ``--retries`` retries,
or a reply without a score, fails *that sample* (its reason in ``ScoredBatch.failed``, counted as
``failed:judge``); the rest of the batch is scored. ``RAYLESS_JUDGE_API_KEY``, when set, is sent as
``Authorization: Bearer``. Standard library only (urllib in threads), as ``remote.py``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from reward_service.results import NAN, SourceResult

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 8.0
PLACEHOLDERS = ("{prompt}", "{response}", "{label}")
_NUMBER = r"[-+]?\d+(?:\.\d+)?"


def parse_score(text: str) -> float | None:
    """``Score: 7`` / ``score = 7/10`` (the last such), else the last number in the text."""
    marked = re.findall(rf"score\s*[:=]?\s*\**\s*({_NUMBER})", text, re.IGNORECASE)
    numbers = marked or re.findall(_NUMBER, text)
    return float(numbers[-1]) if numbers else None


def parse_yes_no(text: str) -> float | None:
    """1 for the last ``yes`` / ``correct``, 0 for the last ``no`` / ``incorrect``; None for neither."""
    words = re.findall(r"\b(yes|no|correct|incorrect)\b", text, re.IGNORECASE)
    return None if not words else float(words[-1].lower() in ("yes", "correct"))


def regex_parser(pattern: str) -> Callable[[str], float | None]:
    """``re:PATTERN``: the first match's group 1 (or the whole match) as a number."""
    rx = re.compile(pattern)

    def parse(text: str) -> float | None:
        m = rx.search(text)
        if not m:
            return None
        try:
            return float(m.group(1) if rx.groups else m.group(0))
        except ValueError:
            return None

    return parse


PARSERS: dict[str, Callable[[str], float | None]] = {"score": parse_score, "yes_no": parse_yes_no}


def make_parser(spec: str) -> Callable[[str], float | None]:
    """A parser by name (``PARSERS``) or ``re:PATTERN``; raises ValueError naming what is wrong."""
    if spec.startswith("re:"):
        try:
            return regex_parser(spec[3:])
        except re.error as e:
            raise ValueError(f"--judge_parser {spec!r}: bad regular expression ({e})") from None
    if spec not in PARSERS:
        raise ValueError(f"--judge_parser {spec!r} unknown: choose {', '.join(PARSERS)} or re:PATTERN")
    return PARSERS[spec]


def load_template(path: str) -> str:
    """The prompt template's text; raises ValueError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--judge_prompt {path}: cannot read it ({e.strerror})") from None
    if "{response}" not in text:
        raise ValueError(f"--judge_prompt {path} has no {{response}} placeholder: the judge would not see the answer")
    return text


def render(template: str, prompt: str, response: str, label) -> str:
    values = {"{prompt}": prompt, "{response}": response, "{label}": "" if label is None else str(label)}
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda m: values[m.group(0)], template)


class JudgeReward:
    """Reward source "judge": one chat request per sample to an OpenAI-compatible server."""

    needs_text = True

    def __init__(
        self,
        url: str,
        *,
        model: str,
        template: str,
        parser: str = "score",
        scale: float = 1.0,
        max_tokens: int = 512,
        temperature: float = 0.0,
        concurrency: int = 16,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        self.url = url.rstrip("/") + "/chat/completions"
        self.name = "judge"
        self.model, self.template, self.parse = model, template, make_parser(parser)
        self.scale, self.max_tokens, self.temperature = scale, max_tokens, temperature
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward-judge")
        self._headers = {"Content-Type": "application/json"}
        if os.environ.get("RAYLESS_JUDGE_API_KEY"):
            self._headers["Authorization"] = f"Bearer {os.environ['RAYLESS_JUDGE_API_KEY']}"

    def __call__(self, queries: list[str], prompts: list[str], labels: list, responses=None, **_) -> SourceResult:
        if responses is None:
            responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts, strict=True)]
        futs = [
            self._pool.submit(self._one, render(self.template, p, r, lab))
            for p, r, lab in zip(prompts, responses, labels, strict=True)
        ]
        rewards: list[float] = []
        failed: list[str | None] = []
        for f in futs:
            score, why = f.result()
            rewards.append(NAN if score is None else score / self.scale)
            failed.append(why)
        n_failed = sum(w is not None for w in failed)
        if n_failed:
            first = next(w for w in failed if w)
            log.warning("judge: %d of %d samples failed; first: %s", n_failed, len(failed), first)
        return SourceResult(rewards=rewards, failed=failed)

    def _one(self, content: str) -> tuple[float | None, str | None]:
        """(score, None) or (None, why this sample failed)."""
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
            }
        ).encode()
        err = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                text = self._post(body)
            except _AttemptFailed as e:
                err = str(e)
                continue
            score = self.parse(text)
            if score is None:  # the judge answered: asking again would mostly repeat it
                return None, f"judge: no score in the reply: {text[-200:]!r}"
            return score, None
        return None, f"judge {self.url} failed after {self.retries + 1} attempts; last: {err}"

    def _post(self, body: bytes) -> str:
        req = urllib.request.Request(self.url, data=body, method="POST", headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                data = resp.read()
        except urllib.error.HTTPError as e:
            raise _AttemptFailed(f"HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            raise _AttemptFailed(f"{type(reason).__name__}: {reason}") from None
        try:
            content = json.loads(data)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _AttemptFailed(f"not an OpenAI chat completion: {data[:120]!r}") from None
        if not isinstance(content, str):
            raise _AttemptFailed(f"the reply's content is {type(content).__name__}, not text")
        return content

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _AttemptFailed(Exception):
    pass
