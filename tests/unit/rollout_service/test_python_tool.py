"""examples/agents/python_tool.py in real environment-worker processes (rollout_service/env_pool.py)
on a scripted engine: the policy's code runs in common.sandbox inside the worker, its output (or
why it failed) comes back as the environment's answer, and the final answer is scored."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from helpers.agent_fakes import CharTokenizer, ScriptedRequest, ids, same_params
from helpers.paths import HELPERS
from rollout_service.agent import TurnEngine
from rollout_service.env_pool import EnvPool

TOOL = str(HELPERS.parents[1] / "examples/agents/python_tool.py")
EOS = CharTokenizer.eos_token_id


@pytest.fixture(autouse=True)
def _helpers_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HELPERS.parent))  # the workers build the char tokenizer
    monkeypatch.setenv("RAYLESS_SANDBOX_WORKERS", "1")


def action(text: str) -> list[int]:
    return [*ids(text), EOS]


async def episode(pool, actions: list[str], label: str, pid: int):
    engine = TurnEngine(
        ScriptedRequest([action(a) for a in actions]), same_params, prompt_token_ids=ids("Q"), max_len=4096
    )
    return await pool.run_episode(
        engine,
        prompt_id=pid,
        prompt_text="Q",
        label=label,
        sampling_params=SimpleNamespace(max_tokens=256, logprobs=0, temperature=1.0),
        step_timeout_s=30.0,
        episode_timeout_s=0.0,
    )


def test_code_runs_in_the_sandbox_and_its_output_is_the_feedback():
    async def main():
        pool = EnvPool(TOOL, workers=1, tokenizer_factory="helpers.agent_fakes:CharTokenizer", start_timeout_s=60)
        await pool.start()
        try:
            solved = await episode(pool, ["```python\nprint(6 * 7)\n```", "so it is\n42"], "42", 0)
            net = "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 22))\n```"
            refused = await episode(pool, [net, "no idea\n41"], "42", 1)
            return solved, refused
        finally:
            await pool.close()

    solved, refused = asyncio.run(asyncio.wait_for(main(), 120))
    text = CharTokenizer().decode(solved.response)
    assert "[output]\n42\n\n[/output]" in text and solved.reward == 1.0 and solved.turns == 2
    assert solved.extra_logs["tool/calls"] == 1.0 and solved.extra_logs["tool/failed"] == 0.0
    feedback = CharTokenizer().decode(refused.response)
    assert "exited with code 1" in feedback and refused.reward == 0.0
    assert "Network is unreachable" in feedback or "not allowed" in feedback  # namespaces / process mode
    assert refused.extra_logs["tool/failed"] == 1.0
