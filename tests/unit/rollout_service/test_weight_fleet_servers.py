"""The fleet weight group through real rollout servers: one transfer reaches two vLLM engines.

Two ``python -m rollout_service`` processes on the tiny model, the controller side of
``helpers.rollout_harness`` (what the learner's rank 0 runs), weights over gloo: a push to both
goes through one fleet group (the learner sends once; the first server relays to the second),
and both engines then answer exactly alike, and as transformers does on the new weights.
"""

from __future__ import annotations

import pytest
import torch

from common import protocol as P
from common.tiny import ENDOFTEXT_ID, IM_END_ID
from helpers.rollout_harness import Controller, hf_greedy, perturb, samples_of

pytestmark = pytest.mark.slow

STOP = {IM_END_ID, ENDOFTEXT_ID}
GREEDY = P.SamplingParams(temperature=0.0, max_new_tokens=16)
PROMPTS = [[1, 5 + k, 17 + k, 29 + k, 41, 53, 65 + k] for k in range(3)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    # Small buckets and relay pieces: several of each per push, so the relay really pipelines.
    ctrl = Controller(model, peer_timeout_s=30.0, weight_timeout_s=60.0, bucket_bytes=256 * 1024)
    ctrl.publisher.sender.relay_chunk_bytes = 64 * 1024
    logs = tmp_path_factory.mktemp("fleet-logs")
    try:
        ctrl.start("fa", logs)
        ctrl.start("fb", logs)
        ctrl.wait_joined(["fa", "fb"], timeout=900)
        yield ctrl
    finally:
        ctrl.close()


def _generate(stack, server: str, first_id: int, version: int) -> list[dict]:
    ids = list(range(first_id, first_id + len(PROMPTS)))
    stack.ep.send(
        P.PromptBatch(prompt_ids=ids, token_ids=PROMPTS, sampling=GREEDY, policy_version=version), to=server.encode()
    )
    stack.wait_results(ids, timeout=300)
    return [samples_of(stack.results[pid], pid)[0] for pid in ids]


def test_one_fleet_push_reaches_both_engines_bit_exactly(stack):
    for version in (1, 2):
        perturb(stack.model, seed=10 + version)
        report = stack.fleet.push(version)
        # The fleet is in join order, which is whichever engine came up first.
        assert sorted(report.fleet) == ["fa", "fb"] and not report.failed and not report.retried, report
        assert stack.publisher.fleet_builds == 1  # the same two servers: the group is kept
        got = {
            s: _generate(stack, s, first_id=1000 * version + 100 * i, version=version)
            for i, s in enumerate(("fa", "fb"))
        }
        # The same weights in both engines, to the bit: identical tokens and log-probs.
        assert [g["tokens"] for g in got["fa"]] == [g["tokens"] for g in got["fb"]]
        assert [g["logprobs"] for g in got["fa"]] == [g["logprobs"] for g in got["fb"]]
        for prompt, sample in zip(PROMPTS, got["fa"], strict=True):
            want_tokens, want_lps = hf_greedy(stack.model, prompt, GREEDY.max_new_tokens, STOP)
            assert sample["tokens"] == want_tokens and sample["version"] == version
            assert torch.allclose(torch.tensor(sample["logprobs"]), torch.tensor(want_lps), atol=1e-4)
