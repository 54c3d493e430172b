"""The raw ZeroMQ limit of ``bench/fleet.py``: the same bytes through a bare ROUTER relay.

The same stand-in processes as the controller's run (``Fleet(raw=True)``: bare DEALERs that
answer every message with frames encoded once) and the same message sizes: each prompt goes
out as a PromptBatch of one prompt; each SampleBatch's token-id frame goes on to a reward stand-in
behind a ScoreRequest header encoded once (with the prompt tokens, text and labels of its G
samples); the ScoredBatch that comes back frees a place. At most ``bound`` prompts are out at
once, ``per_server`` at each server, as in the controller's run. No protocol objects, ledger or
pool: what moving these bytes through one process costs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

import zmq
from fleet_measure import Clock, Counting, Window
from fleet_run import Fleet, RunConfig

from helpers.fleet_standins import RAW_HELLO, VOCAB

log = logging.getLogger("bench.fleet")


def relay_run(cfg: RunConfig) -> dict[str, Any]:
    """The same bytes through a bare ROUTER relay (``fleet_run.process_body``)."""
    import collections
    import itertools

    from common import protocol as P
    from common.transport import DEFAULT_HWM
    from helpers.fleet_standins import sample_arrays, sample_batch

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    for opt, val in ((zmq.SNDHWM, DEFAULT_HWM), (zmq.RCVHWM, DEFAULT_HWM), (zmq.ROUTER_MANDATORY, 1), (zmq.LINGER, 0)):
        router.setsockopt(opt, val)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    fleet = Fleet(f"tcp://127.0.0.1:{port}", cfg, raw=True)
    fleet.start()
    try:
        rollouts, rewards = [], []
        deadline = time.monotonic() + 300
        while len(rollouts) < cfg.servers or len(rewards) < cfg.rewards:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw stand-ins: {len(rollouts)} rollout, {len(rewards)} reward connected")
            if router.poll(1000):
                ident, msg = router.recv_multipart()
                if msg == RAW_HELLO:
                    (rollouts if ident.startswith(b"rollout") else rewards).append(ident)
        # What the controller would send: one prompt per PromptBatch, and a ScoreRequest whose
        # header carries the prompt tokens, text and labels of one prompt's G samples.
        codec = P.Codec()
        tokens = [(7 * i) % VOCAB for i in range(cfg.prompt_tokens)]
        sampling = P.SamplingParams(n=cfg.group, max_new_tokens=cfg.tokens)
        prompt = [
            bytes(memoryview(f))
            for f in codec.encode(P.PromptBatch(prompt_ids=[0], token_ids=[tokens], sampling=sampling))
        ]
        ids, lps = sample_arrays(cfg.group, cfg.tokens)
        sb = sample_batch([0], cfg.group, cfg.tokens, ids, lps, 0, "raw")
        sb.prompt_token_ids = [tokens] * cfg.group
        sb.logprobs = None  # as the controller: a reward service is sent tokens, not the sampler's log-probs
        req = P.ScoreRequest(samples=sb, prompts=["x" * (4 * cfg.prompt_tokens)] * cfg.group, labels=["42"] * cfg.group)
        head = [bytes(memoryview(f)) for f in codec.encode(req)[:2]]
        # As the controller, at most ``bound`` prompts out at once (generating or scoring), at
        # most ``per_server`` at each rollout stand-in: a prompt goes out when one comes back scored.
        rollout_set = set(rollouts)
        free = collections.deque(r for r in rollouts for _ in range(cfg.per_server))
        next_reward = itertools.cycle(rewards).__next__
        size = Counting.size
        totals = {"in": 0, "out": 0, "samples": 0}
        window = Window(lambda: (totals["in"], totals["out"]), lambda: totals["samples"])
        prompt_bytes = sum(len(f) for f in prompt)
        head_bytes = sum(len(f) for f in head)
        outstanding = 0

        def dispatch() -> None:
            nonlocal outstanding
            while outstanding < cfg.bound and free:
                router.send_multipart([free.popleft(), *prompt], copy=False)
                totals["out"] += prompt_bytes
                outstanding += 1

        dispatch()
        clock = Clock(cfg, window, None, None)
        while clock.running():
            if not router.poll(50):
                continue
            while True:
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                totals["in"] += sum(size(f) for f in frames[1:])
                ident = frames[0].bytes
                if ident in rollout_set:
                    # frames: identity, type, header, response ids, log-probs: the ids go on
                    router.send_multipart([next_reward(), *head, frames[3]], copy=False)
                    totals["out"] += head_bytes + size(frames[3])
                    free.append(ident)
                else:
                    outstanding -= 1
                    totals["samples"] += cfg.group
            dispatch()
        result = window.close()
    finally:
        fleet.stop()
        router.close(0)
        ctx.term()
    result["config"] = asdict(cfg)
    return result
