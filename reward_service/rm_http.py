"""The reward model over HTTP: a socket-free core (``RMCore``) and its server (``run``).

``RMCore.answer(body) -> (status, payload)`` is the whole protocol of ``python -m
reward_service.serve_rm`` (docs/reward.md): a request body in, an HTTP status and a JSON-able
answer out, no sockets; tests drive it in-process. ``RMCore.rewards(queries)`` is the scoring
alone: the RM's own tokenizer (no special tokens, cut to ``max_len``), then the reward service's
``RewardModelScorer`` (head at the last non-pad token).

The transport is the standard library's ``ThreadingHTTPServer``: one thread per connection reads
and answers its requests, the model runs one request at a time under a lock (a second forward
would only split the same cores; the lock also keeps the tokenizer single-threaded). Every answer,
an error included, is a JSON object with a Content-Length. A body larger than ``max_body_mb`` is
refused before it is read and the connection closed, so a client cannot make the server hold
more than that; a client that stops sending mid-request is dropped after ``READ_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from reward_service.reward_model import RewardModelScorer
from reward_service.serve_rm import ServeRMConfig

log = logging.getLogger("reward_service.serve_rm")

ROUTE = "/get_reward"  # OpenRLHF's
READ_TIMEOUT_S = 60.0  # a request whose bytes stop coming for this long is dropped
DISCARD_BYTES = 2**20  # of a refused body, read and dropped before closing (see _discard_briefly)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RequestError(ValueError):
    """A request that cannot be scored as sent: answered ``status`` with the message and field."""

    def __init__(self, message: str, field: str, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


class RMCore:
    """Scores OpenRLHF ``serve_rm`` requests with a loaded reward model; owns no socket."""

    def __init__(self, rm: RewardModelScorer, tokenizer: Any, max_len: int) -> None:
        self.rm, self.tokenizer, self.max_len = rm, tokenizer, max_len
        self._lock = threading.Lock()  # one forward at a time
        self._stats_lock = threading.Lock()  # counters, never held across a forward
        self.requests = self.samples = self.bad_requests = 0

    def rewards(self, queries: list[str]) -> list[float]:
        """One float per query text. Raises RequestError naming a query that has no tokens."""
        if not queries:
            return []
        with self._lock:
            ids = self.tokenizer(queries, add_special_tokens=False, truncation=True, max_length=self.max_len)[
                "input_ids"
            ]
            for i, row in enumerate(ids):
                if not row:
                    raise RequestError(f"query[{i}] has no tokens to score (empty text?)", f"query[{i}]")
            return self.rm.rewards([torch.tensor(row, dtype=torch.long) for row in ids]).tolist()

    def answer(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON object) for one ``POST /get_reward`` body."""
        try:
            queries = parse_request(body)
            rewards = self.rewards(queries)
        except RequestError as e:
            with self._stats_lock:
                self.bad_requests += 1
            return e.status, {"error": str(e), "field": e.field}
        with self._stats_lock:
            self.requests += 1
            self.samples += len(queries)
        return 200, {"rewards": rewards, "scores": rewards, "extra_logs": {}}


def parse_request(body: bytes) -> list[str]:
    """The ``query`` list of a request body; RequestError naming the field at fault."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError as e:
        raise RequestError(f"body is not UTF-8 JSON: {e}", "body") from None
    except ValueError as e:
        raise RequestError(f"body is not JSON: {e}", "body") from None
    if not isinstance(data, dict):
        raise RequestError(f"body must be a JSON object with 'query', got a JSON {type(data).__name__}", "body")
    if "query" not in data:
        raise RequestError(f"missing 'query' (a list of prompt + response texts); got keys {sorted(data)[:8]}", "query")
    queries = data["query"]
    if not isinstance(queries, list):
        raise RequestError(f"'query' must be a list of strings, got {_json_type(queries)}", "query")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(f"query[{i}] is {_json_type(q)}, expected a string", f"query[{i}]")
    return queries


def _json_type(v: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


class _Handler(BaseHTTPRequestHandler):
    """One connection; ``server.core`` scores, ``server.max_body`` bounds what is read."""

    protocol_version = "HTTP/1.1"  # keep-alive: a client may send its batches on one connection
    default_request_version = "HTTP/1.0"  # a garbled request line is answered with a status line too
    timeout = READ_TIMEOUT_S
    server: _Server

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != ROUTE:
            self._reply(404, {"error": f"no route {path}: POST {ROUTE}", "field": "path"})
            return
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._reply(411, {"error": "send the body with a Content-Length, not chunked", "field": "Content-Length"})
            self._discard_briefly()
            return
        raw = self.headers.get("Content-Length")
        if raw is None:
            self._reply(411, {"error": "a POST needs a Content-Length header", "field": "Content-Length"})
            return
        try:
            length = int(raw)
            if length < 0:
                raise ValueError
        except ValueError:
            self._reply(400, {"error": f"Content-Length {raw!r} is not a length", "field": "Content-Length"})
            return
        if length > self.server.max_body:
            self._reply(
                413,
                {
                    "error": f"body of {length} bytes is over --max_body_mb ({self.server.max_body} bytes)",
                    "field": "body",
                },
            )
            self._discard_briefly()
            return
        body = self.rfile.read(length)
        t0 = time.monotonic()
        try:
            status, payload = self.server.core.answer(body)
        except Exception as e:  # a forward that raised (out of memory ...): this request fails, the server stays
            log.exception("scoring failed")
            status, payload = 500, {"error": f"scoring failed: {type(e).__name__}: {e}"}
        if status == 200:
            log.debug("scored %d queries in %.3f s", len(payload["rewards"]), time.monotonic() - t0)
        self._reply(status, payload)

    def _discard_briefly(self) -> None:
        """Reads (and drops) what the client has already sent of a refused body, a bounded amount
        for a bounded time, before the connection closes: a socket closed with unread bytes
        sends a reset, which can destroy the 413 answer before the client reads it."""
        self.connection.settimeout(0.2)
        try:
            for _ in range(DISCARD_BYTES // 65536):
                if not self.connection.recv(65536):
                    break
        except OSError:  # nothing more within the timeout, or the client went away
            pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            core = self.server.core
            self._reply(200, {"status": "ok", "requests": core.requests, "samples": core.samples})
        elif path == ROUTE:
            self._reply(405, {"error": f"{ROUTE} takes POST", "field": "method"}, allow="POST")
        else:
            self._reply(404, {"error": f"no route {path}: POST {ROUTE}", "field": "path"})

    def _wrong_method(self) -> None:
        self._reply(405, {"error": f"{self.command} is not served: POST {ROUTE}", "field": "method"}, allow="POST")

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _wrong_method

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a garbled request line, headers too long) as JSON too; a
        method it has no handler for is a 405 (its 501 would read as the server's fault)."""
        if code == 501:
            self._reply(405, {"error": f"{message}: POST {ROUTE}", "field": "method"}, allow="POST, GET")
            return
        self._reply(code, {"error": message or self.responses.get(code, ("error",))[0], "field": "request"})

    def _reply(self, status: int, payload: dict[str, Any], allow: str = "") -> None:
        if status >= 400:
            # what follows a refused request may be the rest of its body: never read it as a request
            self.close_connection = True
            log.warning("%s %s -> %d: %s", self.command, getattr(self, "path", ""), status, payload.get("error"))
        out = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        if allow:
            self.send_header("Allow", allow)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never holds the process open at exit

    def __init__(self, address: tuple[str, int], core: RMCore, max_body: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.core, self.max_body = core, max_body
        super().__init__(address, _Handler)


def make_server(core: RMCore, host: str, port: int, max_body: int) -> _Server:
    """A bound, listening server (not yet serving): ``server.server_address`` has the port."""
    return _Server((host, port), core, max_body)


def load_core(cfg: ServeRMConfig) -> RMCore:
    """The reward model and its tokenizer, as ``cfg`` says."""
    from transformers import AutoTokenizer

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    rm = RewardModelScorer.load(
        cfg.reward.model_name_or_path,
        dtype=DTYPES[cfg.ds.param_dtype],
        device=device,
        attn_implementation=_attention(cfg.ds.attn_implementation, device),
        # no --batch_size: the whole request in one forward (OpenRLHF's meaning)
        micro_batch_size=cfg.batch_size or 2**31,
        value_head_prefix=cfg.ds.value_head_prefix,
        normalize=cfg.reward.normalize_enable,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        cfg.reward.model_name_or_path, use_fast=not cfg.data.disable_fast_tokenizer
    )
    return RMCore(rm, tokenizer, cfg.data.max_len)


def _attention(asked: str, device: str) -> str:
    """``asked``, but SDPA with a notice when FlashAttention cannot run here."""
    if not asked.startswith("flash_attention"):
        return asked
    import importlib.util

    if device.startswith("cuda") and importlib.util.find_spec("flash_attn"):
        return asked
    log.warning("--ds.attn_implementation %s needs CUDA and the flash_attn package; using sdpa", asked)
    return "sdpa"


def run(cfg: ServeRMConfig, on_ready: Callable[[_Server], None] | None = None) -> int:
    """Loads the model, listens, serves until a signal. Exit codes as common.service's."""
    from common.net import is_loopback
    from common.service import ExitCode, signal_exit_code
    from reward_service.reward_model import RewardModelError

    stop: list[int] = []

    def on_signal(signum, _frame):
        stop.append(signum)
        raise KeyboardInterrupt  # leaves serve_forever on the main thread

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        core = load_core(cfg)
        server = make_server(core, cfg.host, cfg.port, int(cfg.max_body_mb * 2**20))
    except KeyboardInterrupt:
        return signal_exit_code(stop[0] if stop else signal.SIGINT)
    except (OSError, ValueError, RewardModelError) as e:  # a path, a head, a port: one line, exit 2
        log.error("cannot start: %s: %s", type(e).__name__, e)
        return ExitCode.NO_START
    host, port = server.server_address[:2]
    if not is_loopback(cfg.host):
        log.warning(
            "--host %s: listening beyond this machine; anyone who reaches port %d can score with this model "
            "(there is no authentication). Bind 127.0.0.1 and tunnel, or firewall the port",
            cfg.host,
            port,
        )
    log.info("serving %s on http://%s:%d%s", cfg.reward.model_name_or_path, _url_host(str(host)), port, ROUTE)
    if on_ready is not None:
        on_ready(server)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    log.info("stopped after %d requests (%d samples, %d refused)", core.requests, core.samples, core.bad_requests)
    return signal_exit_code(stop[0] if stop else signal.SIGINT)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
