"""An OpenAI-compatible endpoint for the agent episodes a rollout server runs (``--openai_api``).

Agents written against the OpenAI API (the ``openai`` client, an agent framework that speaks it)
train as they are: each episode gets its own base URL and key on this server's loopback
endpoint, and every call it makes is one turn of that episode through the server's version gate
(``TurnEngine``: versions, staleness, aborts, limits as for any sample), recorded with its exact
token ids and log-probs and stitched into the episode's sample (``rollout_service/trace.py``).

Served, per episode (``/e/<key>/v1/...``, or ``/v1/...`` with ``Authorization: Bearer <key>``):
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST /tokenize``.
What differs from vLLM's own server, and why (the sample must be what the policy sampled):

* ``n`` is 1 and ``stream`` off (a 400 says so); calls of an episode are sequential (a trace is
  one line of turns: a call while another of the episode runs is refused);
* temperature, top-p, top-k and the seed are the learner's (``--temperature`` ...): the learner's
  log-probs and the importance-sampling correction assume them; a request's own are ignored;
* ``max_tokens`` (or ``max_completion_tokens``) is capped by ``--generate_max_len`` and by what
  is left of the episode's ``--max_len``; ``stop`` strings are refused (the engine does not
  detokenize while it samples); ``logprobs`` returns the sampled tokens' log-probs, no
  alternatives (``top_logprobs`` > 0 is refused);
* ``tools`` (OpenAI's format) reach the chat template and the reply's tool calls are parsed by
  vLLM's own parser named by ``--tool_call_parser`` (as vLLM's ``--tool-call-parser``), returned
  as ``tool_calls`` with ``finish_reason: "tool_calls"``;
* any ``model`` name is accepted (``/v1/models`` lists the served model's).

A call the episode's trace cannot take (a conversation that does not extend the previous call's,
see ``trace.py``) is answered 400 and fails the episode with that message even if the agent
catches the error: a sample whose turns do not line up must not train.

Two ways in, one answer (``OpenAIEndpoint.answer``: a key, what is asked, the JSON body):

* the client rayless hands an agent (``agent_openai.py``) carries its requests in-process
  (``InProcessTransport``, an ``httpx`` transport): no socket and no HTTP parsing on either side,
  on the loop that also drives the engine, where every millisecond a call costs is the engine's;
* any other client (one the agent builds from its base URL, a library, a subprocess) reaches the
  HTTP server: aiohttp's, on the server's own event loop (no thread: a call reaches the engine
  without crossing loops), bound to 127.0.0.1 on a free port; signals are left to the rollout
  server. Not FastAPI on uvicorn, which vLLM's own server uses: on a 2-core host under load a
  request through uvicorn took 48 ms whatever the handler did, 5 ms through aiohttp.web with the
  same client (httpx), 0.4 ms through a bare asyncio socket (2026-12-04).

``python bench/agent.py --openai`` prints a call's time both ways and the episodes/s of each
against the direct agent contract. Requests are read as plain JSON (no pydantic model per call).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import time
import uuid
from typing import Any

import httpx

from rollout_service.agent import EpisodeError, TurnEngine
from rollout_service.trace import Call, Trace, TraceError

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the endpoint answers 400 without touching the trace (a field it does not serve)."""


def tool_parser_class(name: str) -> Any:
    """vLLM's tool parser registered as ``name`` (``--tool_call_parser``); ValueError naming the
    known ones otherwise."""
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ValueError(f"--tool_call_parser {name!r}: vLLM has no such tool parser (known: {known})") from None


def _refuse_unserved(body: dict) -> None:
    if body.get("stream"):
        raise RequestError("'stream': true is not served: an episode's calls are answered whole (stream off)")
    if body.get("n", 1) not in (1, None):
        raise RequestError(f"'n' must be 1 (each call is one turn of one episode), got {body.get('n')!r}")
    if body.get("stop"):
        raise RequestError("'stop' strings are not served (the engine samples without detokenizing); stop on EOS")
    if (body.get("top_logprobs") or 0) > 0 or (isinstance(body.get("logprobs"), int) and body["logprobs"] > 1):
        raise RequestError("top log-probs are not served: only the sampled token's log-prob ('logprobs': true)")
    fmt = body.get("response_format")
    if fmt and fmt.get("type", "text") != "text":
        raise RequestError(f"'response_format' {fmt.get('type')!r} is not served (no guided decoding in training)")


class EpisodeSession:
    """One episode's view of the endpoint: its key, its trace, the engine its calls go to.

    ``params``: the episode's vLLM sampling parameters (the learner's; a per-turn cap in
    ``max_tokens``); ``tool_parser``: a vLLM ``ToolParser`` class or None.
    """

    def __init__(
        self,
        engine: TurnEngine,
        tokenizer: Any,
        params: Any,
        *,
        model: str,
        tool_parser: Any = None,
        template_kwargs: dict | None = None,
    ) -> None:
        self.key = secrets.token_urlsafe(18)
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.model, self.tool_parser = model, tool_parser
        self.trace = Trace(tokenizer, template_kwargs)
        self.error: str | None = None  # the first call the trace refused: fails the episode
        self.truncated = False  # a call past --max_len or --agent_max_turns was refused
        self.closed = False
        self._running: int | None = None  # the call number in the engine, if any
        self._call_task: asyncio.Task | None = None  # the HTTP handler running it
        self._tool_parsers: dict[str, tuple[Any, Any]] = {}  # tool_choice (JSON) -> (parser, request)

    def close(self) -> None:
        """The episode ended (or was cancelled): a call still in the engine is aborted."""
        self.closed = True
        if self._call_task is not None:
            self._call_task.cancel()

    # ------------------------------------------------------------------ calls
    async def chat(self, body: dict) -> dict:
        _refuse_unserved(body)
        tools = body.get("tools") or None
        if tools is not None and self.tool_parser is None and body.get("tool_choice") != "none":
            raise RequestError("this request has 'tools' but the rollout server has no --tool_call_parser")
        kw = body.get("chat_template_kwargs")
        call = self._prepare(lambda: self.trace.chat_prompt(body.get("messages"), tools, kw))
        action, lps, reason = await self._generate(call, body)
        text = self._text(action, reason, keep_special=tools is not None)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = reason
        if tools is not None and self.tool_parser is not None and body.get("tool_choice") != "none":
            info = self._parse_tools(text, body)
            if info.tools_called:
                message["content"] = info.content
                message["tool_calls"] = [
                    {
                        "id": tc.id,
                        "type": "function",
                        "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                    }
                    for tc in info.tool_calls
                ]
                finish = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": self._logprobs(action, lps)}
        return self._response("chat.completion", body, call, action, choice)

    async def completion(self, body: dict) -> dict:
        _refuse_unserved(body)
        if body.get("echo") or body.get("suffix"):
            raise RequestError("'echo' and 'suffix' are not served")
        call = self._prepare(lambda: self.trace.completion_prompt(body.get("prompt")))
        action, lps, reason = await self._generate(call, body, returns_text=True)
        text = self._text(action, reason, keep_special=False)
        self.trace.calls[-1].text += text
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        if body.get("logprobs"):
            toks = [self.tokenizer.decode([t]) for t in action]
            choice["logprobs"] = {"tokens": toks, "token_logprobs": lps, "top_logprobs": None, "text_offset": None}
        return self._response("text_completion", body, call, action, choice)

    def tokenize(self, body: dict) -> dict:
        """vLLM's ``/tokenize``: a prompt's or a conversation's tokens as this model reads them
        (not the episode's trace: an agent counting its context)."""
        if body.get("messages") is not None:
            msgs = [dict(m) for m in body["messages"]]
            text = self.tokenizer.apply_chat_template(
                msgs,
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                tokenize=False,
                **{**self.trace.template_kwargs, **(body.get("chat_template_kwargs") or {})},
            )
            toks = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        elif isinstance(body.get("prompt"), str):
            toks = list(
                self.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
            )
        else:
            raise RequestError("/tokenize needs 'prompt' (text) or 'messages'")
        return {"count": len(toks), "max_model_len": self.engine.max_len, "tokens": toks}

    # ------------------------------------------------------------------ helpers
    def _prepare(self, build: Any) -> Call:
        if self.closed:
            raise RequestError("this episode has ended; its key serves no more calls")
        k = len(self.trace.calls) + 1
        if self._running is not None:
            raise self._failed(
                f"call {k} arrived while call {self._running} of the episode was still running: an episode's calls "
                "must be sequential (its sample is one line of turns)"
            )
        if self.error is not None:
            raise TraceError(f"this episode already failed: {self.error}")
        try:
            return build()
        except TraceError as e:
            raise self._failed(str(e)) from None

    def _failed(self, message: str) -> TraceError:
        """The episode fails with the first such message (even if the agent catches the 400)."""
        if self.error is None:
            self.error = message
        return TraceError(message)

    async def _generate(self, call: Call, body: dict, returns_text: bool = False) -> tuple[list[int], list[float], str]:
        k = len(self.trace.calls) + 1
        params = copy.copy(self.params)  # the learner's choices; only the length is the request's
        cap = params.max_tokens
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None:
            if not isinstance(asked, int) or asked < 1:
                raise RequestError(f"'max_tokens' must be a positive integer, got {asked!r}")
            cap = min(cap, asked) if cap else asked
        params.max_tokens = cap
        self._running, self._call_task = k, asyncio.current_task()
        turns = len(self.engine.turns)
        try:
            out = await self.engine.generate(call.prompt, params)
        except EpisodeError as e:
            if len(self.engine.turns) == turns and ("--max_len" in str(e) or "--agent_max_turns" in str(e)):
                self.truncated = True  # the episode's limits: it ends here ("length"), not failed
                raise RequestError(f"call {k}: {e}; the episode is over") from None
            raise
        finally:
            self._running, self._call_task = None, None
        del out  # the engine's record holds what the sample needs
        turn = self.engine.turns[-1]
        self.trace.record(call, turn.action, turn.finish_reason)
        return turn.action, turn.logprobs, turn.finish_reason

    def _text(self, action: list[int], reason: str, keep_special: bool) -> str:
        toks = action
        if reason == "stop" and toks and toks[-1] in self.trace._special:
            toks = toks[:-1]  # the stop/EOS token is not part of the answer (as vLLM returns it)
        return self.tokenizer.decode(toks, skip_special_tokens=not keep_special)

    def _parse_tools(self, text: str, body: dict) -> Any:
        # One parser and one request per episode and tool choice: an episode's tools never change
        # (the trace refuses it), and building vLLM's parser can read the whole vocabulary (a real
        # model's: 150k entries) and the request validates every message (the conversation grows).
        # The parser reads the reply's text and the request's tools, not the messages.
        choice = body.get("tool_choice", "auto")
        cache_key = json.dumps(choice, sort_keys=True)
        if cache_key not in self._tool_parsers:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

            request = ChatCompletionRequest(model=self.model, messages=[], tools=body.get("tools"), tool_choice=choice)
            self._tool_parsers[cache_key] = (self.tool_parser(self.tokenizer, request.tools), request)
        parser, request = self._tool_parsers[cache_key]
        return parser.extract_tool_calls(text, request)

    def _logprobs(self, action: list[int], lps: list[float]) -> list[dict]:
        out = []
        for t, lp in zip(action, lps, strict=True):
            s = self.tokenizer.decode([t])
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
        return out

    def _response(self, obj: str, body: dict, call: Call, action: list[int], choice: dict) -> dict:
        prefix = "chatcmpl" if obj == "chat.completion" else "cmpl"
        return {
            "id": f"{prefix}-{uuid.uuid4().hex[:24]}",
            "object": obj,
            "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(call.prompt),
                "completion_tokens": len(action),
                "total_tokens": len(call.prompt) + len(action),
            },
        }


class OpenAIEndpoint:
    """The loopback HTTP server of one rollout server; episodes ``open`` a session on it."""

    def __init__(self, model: str, host: str = "127.0.0.1") -> None:
        self.model, self.host = model, host
        self.port = 0
        self._sessions: dict[str, EpisodeSession] = {}
        self._runner: Any = None
        self._lock = asyncio.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, session: EpisodeSession) -> str:
        """The episode's own base URL (its key in the path: an agent that sends its own API key,
        or none, still reaches its episode)."""
        return f"{self.url}/e/{session.key}/v1"

    def open(self, session: EpisodeSession) -> EpisodeSession:
        self._sessions[session.key] = session
        return session

    def close(self, session: EpisodeSession) -> None:
        self._sessions.pop(session.key, None)
        session.close()

    async def start(self) -> None:
        """Binds a free loopback port and serves on this event loop (idempotent)."""
        async with self._lock:
            if self._runner is not None:
                return
            from aiohttp import web

            runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self._runner = runner
            log.info("OpenAI-compatible endpoint for agent episodes at %s", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ------------------------------------------------------------------ requests
    def _session(self, key: str | None) -> EpisodeSession:
        s = self._sessions.get(key or "")
        if s is None:
            raise KeyError("no running episode has this key (its base URL or API key); it may have ended")
        return s

    async def answer(self, key: str | None, what: str, body: bytes) -> tuple[int, dict]:
        """One request, whatever carried it: ``what`` is ``chat``, ``completion``, ``tokenize`` or
        ``models``; ``body`` the request's JSON bytes. Returns the HTTP status and the JSON answer
        (an OpenAI-style ``{"error": ...}`` for anything but 200)."""
        try:
            session = self._session(key)
        except KeyError as e:
            return _error(401, str(e.args[0]), "authentication_error")
        try:
            if what == "models":
                return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "rayless"}]}
            parsed = json.loads(body) if body else None
            if not isinstance(parsed, dict):
                return _error(400, "the request body must be a JSON object")
            if what == "chat":
                return 200, await session.chat(parsed)
            if what == "completion":
                return 200, await session.completion(parsed)
            return 200, session.tokenize(parsed)
        except (RequestError, TraceError) as e:
            return _error(400, str(e))
        except ValueError as e:  # a malformed body (JSON, a field of the wrong type)
            return _error(400, f"{type(e).__name__}: {e}")
        except EpisodeError as e:  # the engine refused the agent's input
            return _error(400, str(e))
        except asyncio.CancelledError:  # its episode ended under it (aborted, timed out): nobody reads this
            return _error(499, "the episode ended while this call ran")
        except Exception as e:  # noqa: BLE001 - the server's fault (the engine), answered; the episode fails by its record
            log.warning("agent endpoint: %s failed: %s: %s", what, type(e).__name__, e)
            return _error(500, f"{type(e).__name__}: {e}", "server_error")

    def transport(self) -> InProcessTransport:
        """An ``httpx`` transport that hands a client's requests to ``answer`` in this process."""
        return InProcessTransport(self)

    # ------------------------------------------------------------------ HTTP
    def _app(self) -> Any:
        from aiohttp import web

        def route(what: str) -> Any:
            async def handler(request: web.Request) -> web.Response:
                key = request.match_info.get("key") or _bearer(request.headers.get("Authorization", ""))
                status, answer = await self.answer(key, what, await request.read())
                return web.json_response(answer, status=status)

            return handler

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "episodes": len(self._sessions)})

        app = web.Application(client_max_size=64 * 1024**2)  # a long conversation in one body
        for prefix in ("/e/{key}", ""):  # the episode's base URL, or a bearer key on the plain paths
            app.router.add_post(f"{prefix}/v1/chat/completions", route("chat"))
            app.router.add_post(f"{prefix}/v1/completions", route("completion"))
            app.router.add_get(f"{prefix}/v1/models", route("models"))
            app.router.add_post(f"{prefix}/tokenize", route("tokenize"))
        app.router.add_get("/health", health)
        return app


def _error(status: int, message: str, kind: str = "invalid_request_error") -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": kind, "code": status}}


def _bearer(auth: str) -> str | None:
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


# path suffix, method -> what ``OpenAIEndpoint.answer`` serves
_ROUTES = {
    ("/v1/chat/completions", "POST"): "chat",
    ("/v1/completions", "POST"): "completion",
    ("/v1/models", "GET"): "models",
    ("/tokenize", "POST"): "tokenize",
}


class InProcessTransport(httpx.AsyncBaseTransport):
    """The client side of the endpoint without a socket: what an ``httpx`` client (the ``openai``
    client's) sends to the endpoint's address is answered by ``OpenAIEndpoint.answer`` in this
    process, on this event loop, as the HTTP server would answer it (same paths, keys, statuses and
    JSON). No connection, no HTTP parsing on either side: the ``openai`` client rayless hands an
    agent uses it (``agent_openai.py``); the loopback HTTP server stays for any other client.

    Each request runs in a task of its own, as an HTTP handler would: cancelling the caller (its
    episode ended) cancels the call, which aborts its engine request."""

    def __init__(self, endpoint: OpenAIEndpoint) -> None:
        self.endpoint = endpoint

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path, key = request.url.path, None
        if path.startswith("/e/"):
            key, _, rest = path[3:].partition("/")
            path = "/" + rest
        else:
            key = _bearer(request.headers.get("Authorization", ""))
        what = _ROUTES.get((path, request.method))
        if (request.url.host, request.url.port) != (self.endpoint.host, self.endpoint.port):
            status, answer = _error(
                421,
                f"{request.url}: the client handed to an agent_func reaches only its episode's endpoint "
                f"({self.endpoint.url}); build a client of your own for another server",
            )
        elif what is None:
            status, answer = _error(404, f"{request.method} {request.url.path}: not served by this endpoint")
        else:
            body = await request.aread()
            call = asyncio.ensure_future(self.endpoint.answer(key, what, body))
            try:  # shielded: the call answers a cancel with a 499, which must not swallow the caller's
                status, answer = await asyncio.shield(call)
            except asyncio.CancelledError:
                call.cancel()
                raise
        return httpx.Response(
            status, content=json.dumps(answer).encode(), headers={"content-type": "application/json"}, request=request
        )
