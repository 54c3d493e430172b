"""The rollout server's Abort: the named prompts' tasks are cancelled (which aborts their vLLM
requests, see RolloutCore.generate), others run on, unknown ids are ignored. No engine needed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from common import protocol as P
from helpers.fake_llm import core_on_fake_llm
from rollout_service.config import RolloutConfig
from rollout_service.server import RolloutServer


def test_abort_cancels_exactly_the_named_prompts():
    core = core_on_fake_llm()

    async def main():
        server = RolloutServer(RolloutConfig(model="m"), core, SimpleNamespace(name="r0"))
        tasks = {pid: server._spawn(asyncio.sleep(30)) for pid in (1, 2, 3)}
        for pid, t in tasks.items():
            server._track(pid, t)
        server._abort(P.Abort(prompt_ids=[1, 3, 99], reason="too stale"))
        await asyncio.sleep(0)
        assert tasks[1].cancelled() and tasks[3].cancelled() and not tasks[2].done()
        assert core.metrics()["aborted_by_controller"] == 2
        assert set(server._prompt_tasks) == {2}
        tasks[2].cancel()
        await asyncio.sleep(0.01)  # done callbacks run on a later turn of the loop
        assert server._prompt_tasks == {}  # a finished prompt is forgotten

    asyncio.run(main())
