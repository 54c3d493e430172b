"""Stand-ins for agent tests without vLLM: a character tokenizer and a scripted engine.

``CharTokenizer`` maps each character to its code point (no special tokens), so a text's tokens
are known by hand. ``ScriptedRequest`` answers the i-th generate call of an episode with the
i-th scripted action (token ids, log-prob -0.1 * (k + 1) for its k-th token, version ``version``),
cut to ``max_tokens`` as vLLM would, and records every call.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class CharTokenizer:
    eos_token_id = 3

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def vllm_output(action: list[int], version: int = 0, finish_reason: str = "stop", text: str | None = None) -> Any:
    lps = [{t: SimpleNamespace(logprob=-0.1 * (k + 1))} for k, t in enumerate(action)]
    out = SimpleNamespace(
        index=0,
        token_ids=list(action),
        text=CharTokenizer().decode(action, skip_special_tokens=True) if text is None else text,
        logprobs=lps,
        finish_reason=finish_reason,
        weight_versions=[SimpleNamespace(version=version, start=0, end=len(action))] if action else [],
    )
    return SimpleNamespace(finished=True, outputs=[out])


class ScriptedRequest:
    """``request(token_ids, params) -> (RequestOutput, admitted version)`` of a TurnEngine."""

    def __init__(self, actions: list[list[int]], versions: list[int] | None = None) -> None:
        self.actions = actions
        self.versions = versions or [0] * len(actions)
        self.calls: list[tuple[list[int], int]] = []  # (input tokens, max_tokens)

    async def __call__(self, token_ids: list[int], params: Any) -> tuple[Any, int]:
        k = len(self.calls)
        self.calls.append((list(token_ids), params.max_tokens))
        action = self.actions[k][: params.max_tokens]
        stopped = len(action) == len(self.actions[k])
        return vllm_output(action, self.versions[k], "stop" if stopped else "length"), self.versions[k]


def same_params(p: Any) -> Any:
    """A TurnEngine's ``to_params``: a copy (the server's builds vLLM's SamplingParams)."""
    return SimpleNamespace(max_tokens=getattr(p, "max_tokens", None), logprobs=0)
