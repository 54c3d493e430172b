"""Remote HTTP rewards: OpenRLHF's ``serve_rm`` format, over one or more URLs.

Request: ``POST URL`` with JSON ``{"query": [...], "prompts": [...], "labels": [...]}`` (one
entry per sample; ``query`` is prompt + response text). Answer: a JSON object with
``"rewards"`` (N numbers) and optionally ``"scores"`` and ``"extra_logs"``, checked like a
reward function's answer (``results.from_raw``).

Several URLs: the batch is split into contiguous slices, one per URL, sent in parallel; the
URL a slice goes to first rotates from one batch to the next, so load spreads even for
batches smaller than the URL list. A failed attempt (connection refused, HTTP error, socket
timeout, a body that is not JSON) is retried on the *next* URL after an exponential backoff,
so one dead server costs latency, not samples. After ``retries`` retries the slice's samples
fail with the last error. ``timeout_s`` bounds each socket operation of an attempt.

Standard library only (``urllib``), run in threads: a few requests per batch do not need an
async client. Proxies follow the usual ``http_proxy`` / ``no_proxy`` environment variables.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from reward_service.results import SourceResult, from_raw

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 8.0


class RemoteReward:
    """Reward source "remote": POSTs batches to ``urls``."""

    needs_text = True

    def __init__(self, urls: list[str], *, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("RemoteReward needs at least one URL")
        self.urls = list(urls)
        self.name = "remote"
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._rr = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="reward-http")
        self._lock = threading.Lock()
        self.attempts_failed = 0  # failed HTTP attempts, retried or not (a metric)

    def __call__(self, queries: list[str], prompts: list[str], labels: list, **_) -> SourceResult:
        n = len(queries)
        if n == 0:
            return SourceResult(rewards=[], failed=[])
        k = min(len(self.urls), n)
        first = next(self._rr)
        bounds = [(j * n // k, (j + 1) * n // k) for j in range(k)]
        futs = [
            self._pool.submit(self._slice, (first + j) % len(self.urls), queries[lo:hi], prompts[lo:hi], labels[lo:hi])
            for j, (lo, hi) in enumerate(bounds)
        ]
        return SourceResult.concat([f.result() for f in futs])

    def _slice(self, url_index: int, queries, prompts, labels) -> SourceResult:
        n = len(queries)
        try:
            body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode()
        except (TypeError, ValueError) as e:
            return SourceResult.all_failed(n, f"remote: request is not JSON-serialisable ({e}); check the labels")
        err = ""
        for attempt in range(self.retries + 1):
            url = self.urls[(url_index + attempt) % len(self.urls)]
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                return from_raw(self._post(url, body), n, f"remote {url}")
            except _AttemptFailed as e:
                err = f"{url}: {e}"
                with self._lock:
                    self.attempts_failed += 1
                log.warning("remote reward attempt %d/%d failed: %s", attempt + 1, self.retries + 1, err)
        return SourceResult.all_failed(n, f"remote reward failed after {self.retries + 1} attempts; last: {err}")

    def _post(self, url: str, body: bytes):
        req = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json", "Accept": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                data = resp.read()
        except urllib.error.HTTPError as e:
            raise _AttemptFailed(f"HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, DNS, timeout
            reason = getattr(e, "reason", e)
            raise _AttemptFailed(f"{type(reason).__name__}: {reason}") from None
        try:
            out = json.loads(data)
        except ValueError:
            raise _AttemptFailed(f"answer is not JSON: {data[:120]!r}") from None
        if not isinstance(out, dict):
            raise _AttemptFailed(f"answer is a JSON {type(out).__name__}, expected an object with 'rewards'")
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _AttemptFailed(Exception):
    pass
