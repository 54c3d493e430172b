"""A stand-in for vLLM's ``AsyncLLM`` that ``RolloutCore`` drives in-process (no engine).

It generates one token per 10 ms while not paused and labels each token with the engine's
current weight version, as vLLM does (``weight_versions`` spans); token ``t`` of a request is
``3 + (prompt length + t) % 7`` (text: its digit), log-prob -1.5. It keeps the worker's weight-update
session rules and records the calls it gets.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

VOCAB = 100


class _Collector:
    def __init__(self) -> None:
        self.q: asyncio.Queue = asyncio.Queue()

    def get_nowait(self):
        return None if self.q.empty() else self.q.get_nowait()

    async def get(self):
        return await self.q.get()

    def close(self) -> None:
        pass


class FakeLLM:
    def __init__(self) -> None:
        self.version = ""
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.running: dict[str, asyncio.Task] = {}
        self.prompts: dict[str, dict] = {}
        self.calls: list[str] = []
        self.fail_update = False
        self.errored = False
        self.session = False  # vLLM's worker: a weight update started and neither finished nor failed
        self.model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB, dtype="torch.float32")
        self.stopped = False

    async def add_request(self, req_id, prompt, params, lora_request=None):
        self.prompts[req_id] = dict(prompt)
        col = _Collector()
        self.running[req_id] = asyncio.ensure_future(self._run(req_id, prompt, params, col))
        return col

    async def _run(self, req_id, prompt, params, col):
        toks, versions = [], []
        while len(toks) < params.max_tokens:
            await self.unpaused.wait()
            toks.append(3 + (len(prompt["prompt_token_ids"]) + len(toks)) % 7)
            versions.append(self.version)
            await asyncio.sleep(0.01)
        spans, start = [], 0
        for i in range(1, len(versions) + 1):
            if i == len(versions) or versions[i] != versions[start]:
                spans.append(SimpleNamespace(version=versions[start], start=start, end=i))
                start = i
        out = SimpleNamespace(
            index=0,
            token_ids=toks,
            finish_reason="length",
            weight_versions=spans,
            logprobs=[{t: SimpleNamespace(logprob=-1.5)} for t in toks],
            text="".join(str(t) for t in toks),
        )
        self.running.pop(req_id, None)
        col.q.put_nowait(SimpleNamespace(finished=True, outputs=[out]))

    async def abort(self, req_id):
        self.calls.append("abort")

    async def pause_generation(self, mode="abort", clear_cache=True):
        assert mode == "keep" and not clear_cache
        self.calls.append("pause")
        self.unpaused.clear()

    async def resume_generation(self):
        self.calls.append("resume")
        self.unpaused.set()

    # The worker's session rules (vLLM's Worker: ``_weight_update_active``): a start while one is
    # open raises, a failed receive ends it, the group cannot be shut down during one.
    async def start_weight_update(self):
        self.calls.append("start")
        if self.session:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self.session = True

    async def update_weights(self, request):
        self.calls.append("update")
        if self.fail_update:
            self.session = False
            raise RuntimeError("receiving bucket 2/3 from learner@h:1 failed: Connection reset by peer")

    async def collective_rpc(self, method, args=()):
        if method == "rayless_weight_transfer_engine":  # RolloutCore.create's probe: one gloo worker
            return ["gloo"]
        if method == "rayless_idle_spin_s":
            return [None]
        assert method == "rayless_abandon_weight_update", method
        self.calls.append("abandon")
        was, self.session = self.session, False
        return [was]

    def shutdown(self, timeout=None):  # what common.vllm_quiet.shutdown_async_llm ends with
        self.stopped = True

    async def init_weight_transfer_engine(self, request):
        self.calls.append("init")
        self.init_info = request.init_info

    async def shutdown_weight_transfer_engine(self):
        self.calls.append("shutdown")
        if self.session:
            raise RuntimeError("Cannot release a trainer connection during a weight update")

    async def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")
        self.session = False
        self.version = weight_version

    async def update_weight_version(self, v):
        self.version = v

    async def reset_prefix_cache(self):
        return not self.running  # vLLM refuses while requests hold KV blocks


def core_on_fake_llm(episodes=None, **cfg):
    """A ``RolloutCore`` (max_model_len 64, gloo; ``cfg`` overrides) built by its factory around a
    ``FakeLLM`` at weight version 0; ``episodes``: an ``EpisodeRunner`` (agent tests)."""
    import asyncio

    from rollout_service.config import RolloutConfig
    from rollout_service.core import RolloutCore

    config = RolloutConfig(
        **{
            "model": "m",
            "controller": "tcp://127.0.0.1:1",
            "max_model_len": 64,
            "weight_transfer_backend": "gloo",
            **cfg,
        }
    )
    llm = FakeLLM()
    # The core's own locks and conditions bind to the loop that first awaits them, not this one.
    return asyncio.run(RolloutCore.create(config, engine=llm, episodes=episodes))
