"""One episode's calls to the OpenAI-compatible endpoint, stitched into one token sequence.

An agent written against the OpenAI API sends its whole conversation with every call; the
engine samples from token ids. This file turns each call's messages (or completion prompt) into
the exact token ids the engine continues, such that every call's input extends the previous
call's input and its action *as sampled*, and so the episode is one sequence (its actions
masked 1) whose every token the policy saw when it acted: token in, token out.

How a later chat call's input is built (the "exact reuse" rule):

* the previous call's input and action are taken as they are, token for token;
* the reply that call returned comes back as an assistant message in the conversation: it is not
  rendered again. However the chat template would render it (Qwen3's drops the ``<think>`` block
  of an answer once a later user message follows it; a template may re-serialise a tool call's
  JSON), the policy's own tokens stand in its place, which is what it sampled and what it trains on;
* only the messages after that reply are rendered: the whole conversation goes through the chat
  template with every earlier reply replaced by a placeholder, and the text after the last
  placeholder (the end of the assistant's turn, the new tool/user messages, the generation
  prompt) is tokenized and appended. The template's end-of-turn token that the action already
  ends with (its EOS, e.g. ``<|im_end|>``) is not appended twice; an action cut by the length
  limit gets it as an environment token, as the template writes it.

So a template that rewrites earlier *replies* is no longer a problem. What is refused, with an
error naming the call and the message: a conversation that does not extend the previous call's
(an earlier non-assistant message edited, dropped or reordered, a reply missing or moved, the
``tools`` changed), a call that adds nothing after the reply, a template that does not render a
reply's content verbatim (the placeholder cannot be found), and calls of both kinds (chat and
completions) in one episode. How AReaL, SkyRL, verl and OpenRLHF do this, and why this rule:
``docs/agents.md``.

Completions: the prompt text must start with the previous prompt's text and the text returned
for it (or, as token ids, with the previous input and action); only the rest is tokenized.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout_service.agent import EpisodeError


class TraceError(EpisodeError):
    """A call that cannot extend the episode's trace (the message says which call and why)."""


@dataclass
class Call:
    kind: str  # "chat" | "completion"
    prompt: list[int]  # the exact input the engine continued
    action: list[int] = field(default_factory=list)  # as sampled (stop/EOS token included)
    finish_reason: str = ""
    # chat: the conversation as sent (normalised), the tools; completion: the running text
    messages: list[dict] = field(default_factory=list)
    tools: Any = None
    template_kwargs: dict = field(default_factory=dict)  # the request's chat_template_kwargs, with the trace's
    text: str = ""


def _content_text(content: Any, where: str) -> str | None:
    """A message's content as text: a string, or OpenAI's list of text parts (joined as vLLM
    joins them, by newlines). Images and audio are not served."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise TraceError(f"{where}: only text content is served, got a part of type {kind!r}")
            parts.append(p["text"])
        return "\n".join(parts)
    raise TraceError(f"{where}: 'content' must be text or a list of text parts, got {type(content).__name__}")


def normalise(messages: Any, call: int) -> list[dict]:
    """The messages as the template reads them: role, text content, and the tool fields."""
    if not isinstance(messages, list) or not messages:
        raise TraceError(f"call {call}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"call {call}, message {i}"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TraceError(f"{where}: a message is an object with a 'role'")
        n: dict[str, Any] = {"role": m["role"], "content": _content_text(m.get("content"), where)}
        for k in ("name", "tool_call_id", "tool_calls"):
            if m.get(k) is not None:
                n[k] = m[k]
        if n["role"] == "assistant" and isinstance(n.get("tool_calls"), list):
            # The template reads arguments as an object (vLLM does the same conversion).
            n["tool_calls"] = [_tool_call_for_template(tc) for tc in n["tool_calls"]]
        out.append(n)
    return out


def _tool_call_for_template(tc: Any) -> Any:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            fn = {**fn, "arguments": json.loads(fn["arguments"])}
        except ValueError:
            pass
        return {**tc, "function": fn}
    return tc


def _brief(m: dict | None) -> str:
    if m is None:
        return "nothing"
    text = json.dumps(m.get("content"), ensure_ascii=False)
    return f"{m['role']} {text[:60]}{'...' if len(text) > 60 else ''}"


class Trace:
    """The calls of one episode and the rule that turns the next call into token ids.

    ``tokenizer``: the served model's (``apply_chat_template``, ``__call__``, ``decode``);
    ``template_kwargs``: passed to every ``apply_chat_template`` (e.g. ``enable_thinking``).
    """

    def __init__(self, tokenizer: Any, template_kwargs: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.calls: list[Call] = []
        special = getattr(tokenizer, "all_special_ids", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        self._special = set(special or ([] if eos is None else [eos]))
        self._nonce = uuid.uuid4().hex[:8]

    def _tokens(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render(self, messages: list[dict], tools: Any, call: int, template_kwargs: dict | None = None) -> str:
        kwargs = self.template_kwargs if template_kwargs is None else template_kwargs
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as e:
            raise TraceError(f"call {call}: the chat template refused the conversation: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ chat
    def chat_prompt(self, messages: Any, tools: Any = None, template_kwargs: Any = None) -> Call:
        """The next chat call's input (not yet recorded: ``record`` it once the engine answered).
        ``template_kwargs``: the request's ``chat_template_kwargs`` (e.g. ``enable_thinking``)."""
        k = len(self.calls) + 1
        msgs = normalise(messages, k)
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise TraceError(f"call {k}: 'chat_template_kwargs' must be an object")
        kw = {**self.template_kwargs, **(template_kwargs or {})}
        if not self.calls:
            toks = self._tokens(self.render(msgs, tools, k, kw))
            return Call("chat", toks, messages=msgs, tools=tools, template_kwargs=kw)
        prev = self.calls[-1]
        if prev.kind != "chat":
            raise TraceError(f"call {k} is a chat call after completion calls: an episode's calls are of one kind")
        if tools != prev.tools:
            raise TraceError(
                f"call {k} changed 'tools' from call {k - 1}'s: the policy saw the earlier tools in its prompt"
            )
        if kw != prev.template_kwargs:
            raise TraceError(
                f"call {k} changed 'chat_template_kwargs' from call {k - 1}'s ({prev.template_kwargs} -> {kw}): the "
                "policy's earlier turns were sampled after the template as it rendered then"
            )
        replies = self._reply_positions()  # where call i's reply sits, for i < k - 1
        for i, (was, now) in enumerate(zip(prev.messages, msgs, strict=False)):
            if i in replies:
                if now["role"] != "assistant":
                    raise TraceError(
                        f"call {k}: message {i} should be the reply of call {replies[i] + 1} (an assistant "
                        f"message), got {_brief(now)}: the conversation must extend the earlier calls'"
                    )
            elif now != was:
                turn = sum(1 for p in replies if p < i)
                raise TraceError(
                    f"call {k}: message {i} ({was['role']}) is not what call {k - 1} sent (after turn {turn}): "
                    f"was {_brief(was)}, now {_brief(now)}; an agent may only append to its conversation, since the "
                    "policy's earlier turns were sampled after the message as it was"
                )
        at = len(prev.messages)
        if len(msgs) <= at or msgs[at]["role"] != "assistant":
            raise TraceError(
                f"call {k}: message {at} should be call {k - 1}'s reply (an assistant message), got "
                f"{_brief(msgs[at] if len(msgs) > at else None)}: every reply goes back into the conversation"
            )
        if len(msgs) == at + 1:
            raise TraceError(f"call {k} adds no message after call {k - 1}'s reply (message {at})")
        # Every reply rendered as a placeholder: the text after the last one is what is new.
        marks = [f"rayless-reply-{self._nonce}-{i}" for i in range(len(self.calls))]
        ghost = list(msgs)
        for j, pos in enumerate([*sorted(replies), at]):
            ghost[pos] = {"role": "assistant", "content": marks[j]}
        text = self.render(ghost, tools, k, kw)
        cut = text.find(marks[-1])
        if cut < 0 or text.count(marks[-1]) != 1:
            raise TraceError(
                f"call {k}: the chat template does not render an assistant message's content verbatim (once), so "
                f"the policy's tokens of call {k - 1} cannot be put in its place"
            )
        new = self._tokens(text[cut + len(marks[-1]) :])
        # The action's own end-of-turn token(s), sampled, are not appended again.
        if prev.finish_reason == "stop":
            tail = 0
            while (
                tail < len(prev.action)
                and tail < len(new)
                and prev.action[len(prev.action) - 1 - tail] in self._special
                and prev.action[len(prev.action) - 1 - tail :] == new[: tail + 1]
            ):
                tail += 1
            new = new[tail:]
        return Call("chat", prev.prompt + prev.action + new, messages=msgs, tools=tools, template_kwargs=kw)

    def _reply_positions(self) -> dict[int, int]:
        """Message index -> the call (0-based) whose reply sits there, for every recorded call but
        the last (whose reply is the message right after its own conversation)."""
        return {len(c.messages): i for i, c in enumerate(self.calls[:-1])}

    # ------------------------------------------------------------------ completions
    def completion_prompt(self, prompt: Any) -> Call:
        k = len(self.calls) + 1
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # the API's batch of one
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise TraceError(f"call {k}: 'prompt' must be text or a non-empty list of token ids")
            toks = list(prompt)
            if self.calls:
                prev = self._prev_completion(k)
                seq = prev.prompt + prev.action
                if toks[: len(seq)] != seq:
                    at = next((i for i, (a, b) in enumerate(zip(seq, toks, strict=False)) if a != b), len(toks))
                    raise TraceError(
                        f"call {k}: its prompt's token ids do not extend call {k - 1}'s input and action "
                        f"(first difference at token {at} of {len(seq)})"
                    )
            text = self.tokenizer.decode(toks, skip_special_tokens=False)
            return Call("completion", toks, text=text)
        if not isinstance(prompt, str) or not prompt:
            raise TraceError(f"call {k}: 'prompt' must be text or a non-empty list of token ids")
        if not self.calls:
            return Call("completion", self._tokens(prompt, add_special_tokens=True), text=prompt)
        prev = self._prev_completion(k)
        if not prompt.startswith(prev.text):
            at = next((i for i, (a, b) in enumerate(zip(prev.text, prompt, strict=False)) if a != b), len(prompt))
            raise TraceError(
                f"call {k}: its prompt does not extend call {k - 1}'s prompt and the text returned for it "
                f"(first difference at character {at}: {prompt[at : at + 30]!r} where {prev.text[at : at + 30]!r} was)"
            )
        return Call("completion", prev.prompt + prev.action + self._tokens(prompt[len(prev.text) :]), text=prompt)

    def _prev_completion(self, k: int) -> Call:
        prev = self.calls[-1]
        if prev.kind != "completion":
            raise TraceError(f"call {k} is a completion call after chat calls: an episode's calls are of one kind")
        return prev

    # ------------------------------------------------------------------ record, stitch
    def record(self, call: Call, action: list[int], finish_reason: str, returned_text: str = "") -> None:
        """``call`` answered: ``action`` as sampled; ``returned_text`` (completions) the text the
        agent got for it, which its next prompt must carry on from."""
        call.action, call.finish_reason = list(action), finish_reason
        call.text += returned_text
        self.calls.append(call)

    def stitch(self) -> tuple[list[int], list[tuple[int, int]]]:
        """The episode's whole sequence (the last input and action) and every action's [start, end)."""
        if not self.calls:
            raise TraceError("the agent made no call to the endpoint")
        last = self.calls[-1]
        return last.prompt + last.action, [(len(c.prompt), len(c.prompt) + len(c.action)) for c in self.calls]
