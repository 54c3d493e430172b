"""An executor with the mechanics of OpenRLHF's ``agent_func_openai_server_executor.py`` (written
here from its description, not copied): it keeps the ``llm_engine`` of the first episode it runs,
and calls ``generate`` (with OpenRLHF 0.10's ``multi_modal_data=None``) from an event loop of its
own on a thread of its own, as that file's uvicorn thread does. Each episode is two actions with a
"?" of feedback between them; the sequence and action ranges are its own record, reward 1.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any


class AgentExecutor:
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None) -> Any:
        if not hasattr(self, "engine"):
            self.engine = llm_engine  # the first episode's, kept for every later one
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True).start()
        tokens = list(hf_tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ranges = []
        for turn in range(2):
            params = copy.copy(sampling_params)
            call = self.engine.generate(tokens, params, multi_modal_data=None)
            out = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self.loop))
            action = list(out.outputs[0].token_ids)
            ranges.append((len(tokens), len(tokens) + len(action)))
            tokens = tokens + action + ([ord("?")] if turn == 0 else [])
        return {"observation_tokens": tokens, "action_ranges": ranges, "reward": 1.0, "scores": 1.0}
