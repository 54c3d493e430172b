"""Round trips for every message type and tensor dtype; the codec's rejections."""

import msgspec
import numpy as np
import pytest
import torch

from common import protocol as P
from common.serialization import WireError

codec = P.Codec()


def roundtrip(msg):
    frames = codec.encode(msg)
    # bytes, as they come out of a socket (copy=True) -- the zmq.Frame path is in test_transport
    return codec.decode([bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in frames])


def sample_batch(dtype=torch.int32):
    return P.SampleBatch(
        prompt_ids=[7, 7, 9],
        sample_indices=[0, 1, 0],
        response_lengths=[2, 0, 3],
        response_ids=torch.tensor([1, 2, 3, 4, 5], dtype=dtype),
        logprobs=torch.tensor([-0.5, -1.0, -2.0, -0.25, -3.0]),
        finish_reasons=["stop", "length", "stop"],
        policy_versions=[3, 3, 4],
        server="r0",
    )


def score_request():
    return P.ScoreRequest(
        samples=sample_batch(torch.int64), prompts=["a", "a", "b"], labels=["1", None, {"x": 1}], queries=["q"] * 3
    )


def scored_batch():
    return P.ScoredBatch(
        prompt_ids=[7, 7, 9],
        sample_indices=[0, 1, 0],
        rewards=torch.tensor([1.0, float("nan"), 0.0]),
        ref_logprobs=torch.zeros(5),
        failed=[None, "timeout", None],
        extra_logs={"acc": [1.0, 0.0, 0.0]},
    )


# One example per message type, every field set where it can be. The round-trip test below
# takes its list of types from the protocol's registry, so a new message fails it until it
# has an example here.
EXAMPLES: dict[type, P.Message] = {
    type(m): m
    for m in [
        P.Hello(role="rollout", name="r0", capabilities=P.RolloutCapabilities(capacity=64, model="x", workers=2)),
        P.Hello(role="reward", name="w0", capabilities=P.RewardCapabilities(sources=["ref", "func:f.py"])),
        P.Welcome(peer_id="r0", policy_version=5, config={"sync": {"port": 1234}}),
        P.PromptBatch(
            prompt_ids=[1, 2],
            token_ids=[[5, 6], [7]],
            sampling=P.SamplingParams(n=4, temperature=0.7, stop_token_ids=[2], seed=3),
            policy_version=2,
            seeds=[11, 2**62 - 1],
        ),
        P.Heartbeat(name="r0", seq=3, policy_version=1, stats={"in_flight": 2.0}),
        P.Error(code="bad_request", message="nope", prompt_ids=[1]),
        P.Shutdown(reason="done"),
        P.Ack(info=P.UpdateFinished(policy_version=3, prefix_cache_reset=True)),
        P.Ack(info=P.WorkersJoined(workers=2)),
        P.WeightSyncInit(
            backend="gloo", init_info={"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}, timeout_s=5.0
        ),
        P.WeightUpdateStart(policy_version=4),
        P.WeightUpdate(names=["lm_head.weight"], dtype_names=["bfloat16"], shapes=[[8, 4]]),
        P.WeightUpdateFinish(policy_version=4),
        P.WeightSyncClose(),
        P.Pause(),
        P.Resume(),
        P.Sleep(level=2),
        P.WakeUp(tags=["weights"]),
        P.GetHealth(),
        P.Health(name="r0", state="serving", policy_version=4, stats={"in_flight": 3.0}),
        P.Abort(prompt_ids=[3, 9], reason="older than --max_staleness allows"),
        sample_batch(),
        score_request(),
        scored_batch(),
    ]
}


def same(a, b) -> bool:
    """Field-by-field equality that also compares tensors (dtype, shape, values; NaN == NaN)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(((a == b) | (a != a) & (b != b)).all())
        )
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("cls", list(P.message_types().values()), ids=lambda c: c.__name__)
def test_every_registered_type_roundtrips(cls):
    assert cls in EXAMPLES, f"{cls.__name__} is registered in common/protocol.py: add an example to EXAMPLES"
    msg = msgspec.structs.replace(EXAMPLES[cls], call_id=42)
    assert same(roundtrip(msg), msg)


def test_sample_batch_roundtrip_and_split():
    b = roundtrip(sample_batch())
    assert b.prompt_ids == [7, 7, 9] and b.finish_reasons == ["stop", "length", "stop"]
    assert torch.equal(b.response_ids, torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32))
    parts = b.split_responses()
    assert [p.tolist() for p in parts] == [[1, 2], [], [3, 4, 5]]
    assert [p.tolist() for p in b.split_logprobs()] == [[-0.5, -1.0], [], [-2.0, -0.25, -3.0]]


def test_score_request_and_scored_batch_roundtrip():
    req = roundtrip(score_request())
    assert req.labels == ["1", None, {"x": 1}]
    assert req.samples.response_ids.dtype == torch.int64
    sb = roundtrip(scored_batch())
    assert sb.failed == [None, "timeout", None]
    assert torch.isnan(sb.rewards[1]) and sb.rewards[0] == 1.0


@pytest.mark.parametrize(
    "dtype",
    [
        torch.int32,
        torch.int64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.uint8,
        torch.int8,
        torch.bool,
        torch.float64,
    ],
)
def test_tensor_dtypes_exact(dtype):
    from common.serialization import TensorEncoder, make_ext_hook

    x = (torch.randn(3, 5) * 100).to(dtype)
    header, bufs = TensorEncoder().encode({"x": x})
    bufs = [bytes(b) for b in bufs]
    y = msgspec.msgpack.decode(header, ext_hook=make_ext_hook(lambda: bufs))["x"]
    assert y.dtype == dtype and y.shape == (3, 5)
    assert torch.equal(y, x)


def test_tensor_fields_must_be_tensors_of_the_right_kind():
    with pytest.raises(WireError, match="response_ids must be a tensor"):
        codec.decode(
            [
                bytes([P.SampleBatch.TAG]),
                msgspec.msgpack.encode(
                    {"prompt_ids": [1], "sample_indices": [0], "response_lengths": [2], "response_ids": "ab"}
                ),
            ]
        )
    with pytest.raises(ValueError, match="logprobs must hold float"):
        P.SampleBatch(
            prompt_ids=[1],
            sample_indices=[0],
            response_lengths=[1],
            response_ids=torch.tensor([1]),
            logprobs=torch.tensor([1]),
        )


def test_non_contiguous_and_empty_and_numpy():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    nc = base.t()[1:, ::2]  # non-contiguous view
    assert not nc.is_contiguous()
    for x in (
        nc,
        torch.empty(0, dtype=torch.bfloat16),
        torch.empty(3, 0, dtype=torch.float16),
        torch.arange(4, dtype=torch.bfloat16),
    ):
        b = roundtrip(P.ScoredBatch(prompt_ids=[], sample_indices=[], rewards=torch.empty(0), ref_logprobs=x))
        assert b.ref_logprobs.dtype == x.dtype and torch.equal(b.ref_logprobs, x)
    arr = np.arange(6, dtype=np.int64)
    b = roundtrip(P.SampleBatch(prompt_ids=[1], sample_indices=[0], response_lengths=[6], response_ids=arr))
    assert b.response_ids.tolist() == list(range(6))


@pytest.mark.parametrize(
    "frames, needle",
    [
        ([b"\x01"], "truncated"),
        ([b"\x01\x02", b""], "bad tag frame"),
        ([b"\xfe", b"\x80"], "unknown message type"),
        ([b"\x01", b"\xc1"], "bad Hello"),
        ([bytes([P.Hello.TAG]), msgspec.msgpack.encode({"role": 3, "name": "x"})], "role"),
    ],
)
def test_codec_rejects_malformed(frames, needle):
    with pytest.raises(WireError, match=needle):
        codec.decode(frames)


def test_codec_rejects_inconsistent_batches_naming_the_field():
    good = codec.encode(sample_batch())
    # drop the buffer frames: descriptor points at a missing frame
    with pytest.raises(WireError, match="frame 0 missing"):
        codec.decode(good[:2])
    # a buffer of the wrong size
    with pytest.raises(WireError, match="has 3 bytes"):
        codec.decode([good[0], good[1], b"abc", bytes(memoryview(good[3]))])
    with pytest.raises(WireError, match="response_ids must be a tensor"):
        codec.decode(
            [
                bytes([P.SampleBatch.TAG]),
                msgspec.msgpack.encode(
                    {"prompt_ids": [1], "sample_indices": [0], "response_lengths": [5], "response_ids": "abc"}
                ),
            ]
        )


def test_codec_rejects_oversized():
    small = P.Codec(max_message_bytes=1000)
    with pytest.raises(WireError, match="exceeds the limit"):
        small.decode(codec.encode(P.Error(code="internal", message="x" * 2000)))


def test_sampling_params_validated():
    with pytest.raises(WireError, match="sampling.n"):
        codec.decode(
            [
                bytes([P.PromptBatch.TAG]),
                msgspec.msgpack.encode({"prompt_ids": [1], "token_ids": [[1]], "sampling": {"n": 0}}),
            ]
        )


def test_prompt_batch_seeds_are_checked_naming_the_field():
    P.PromptBatch(prompt_ids=[1, 2], token_ids=[[3], [4]], seeds=[0, 2**62 - 1])
    with pytest.raises(ValueError, match="seeds has 1 entries, expected 2"):
        P.PromptBatch(prompt_ids=[1, 2], token_ids=[[3], [4]], seeds=[5])
    with pytest.raises(ValueError, match=r"seeds must be in \[0, 2\*\*62\)"):
        P.PromptBatch(prompt_ids=[1], token_ids=[[3]], seeds=[-1])


def agent_batch():
    """Two agent episodes: responses [1 2 3] (action, feedback, action) and [4 5]."""
    return P.SampleBatch(
        prompt_ids=[7, 7],
        sample_indices=[0, 1],
        response_lengths=[3, 2],
        response_ids=torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32),
        logprobs=torch.tensor([-0.5, 0.0, -1.0, -0.25, 0.0]),
        finish_reasons=["stop", "length"],
        policy_versions=[3, 3],
        prompt_token_ids=[[9, 9], [9, 9, 8]],
        server="r0",
        episodes=P.EpisodeOutputs(
            action_mask=torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8),
            rewards=[1.5, None],  # None: left to the reward service
            scores=[1.0, None],
            turns=[2, 1],
            logs=[{"tries": 2.0}, {}],
        ),
    )


def test_agent_fields_roundtrip_and_are_checked_naming_the_field():
    b = agent_batch()
    assert same(roundtrip(b), b)
    pb = P.PromptBatch(
        prompt_ids=[1, 2],
        token_ids=[[5], [6]],
        agent=P.AgentParams(agent="env.py:0123456789ab", max_len=64, max_turns=3, step_timeout_s=2.5),
        labels=["12", '{"a": 1}'],
    )
    assert same(roundtrip(pb), pb)
    with pytest.raises(ValueError, match="labels has 1 entries, expected 2"):
        P.PromptBatch(prompt_ids=[1, 2], token_ids=[[5], [6]], labels=["x"])
    for kw, needle in [
        (dict(max_len=1), "agent.max_len must be >= 2"),
        (dict(max_turns=-1), "agent.max_turns must be >= 0"),
        (dict(step_timeout_s=0), "agent.step_timeout_s must be > 0"),
    ]:
        with pytest.raises(ValueError, match=needle):
            P.AgentParams(**{"agent": "a", "max_len": 8, **kw})
    fields = {f: getattr(b, f) for f in b.__struct_fields__}
    ep = {f: getattr(b.episodes, f) for f in b.episodes.__struct_fields__}
    for change, needle in [
        (
            dict(action_mask=torch.ones(4, dtype=torch.uint8)),
            r"episodes.action_mask has 4 entries, response_lengths sum to 5",
        ),
        (dict(action_mask=torch.ones(5)), r"episodes.action_mask must hold int values"),
        (dict(rewards=[1.0]), r"episodes.rewards has 1 entries, expected 2"),
        (dict(turns=[1, 2, 3]), r"episodes.turns has 3 entries, expected 2"),
    ]:
        with pytest.raises(ValueError, match=needle):
            P.SampleBatch(**{**fields, "episodes": P.EpisodeOutputs(**{**ep, **change})})
    with pytest.raises(ValueError, match=r"episodes .agent episodes. need prompt_token_ids"):
        P.SampleBatch(**{**fields, "prompt_token_ids": None})


def test_an_episodes_mask_travels_in_a_frame_of_its_own():
    """The mask is packed as the tokens are (one raw frame, a byte a token), not a msgpack list."""
    b = agent_batch()
    frames = codec.encode(b)
    sizes = sorted(len(memoryview(f).cast("B")) for f in frames[2:])
    assert sizes == [5, 20, 20]  # uint8 mask, int32 tokens, float32 log-probs
    assert same(roundtrip(b).episodes, b.episodes)


def test_agent_episodes_keep_their_fields_through_split_and_concat():
    from learner.controller.batches import concat_samples, select_samples

    b = agent_batch()
    one = select_samples(b, [1])
    assert one.episodes.action_mask.tolist() == [1, 0] and one.episodes.rewards == [None]
    assert one.prompt_token_ids == [[9, 9, 8]] and one.episodes.logs == [{}] and one.episodes.turns == [1]
    both = concat_samples([select_samples(b, [0]), one])  # what a reward service gets: the episodes' prompts
    assert both.prompt_token_ids == b.prompt_token_ids and both.episodes is None
    with pytest.raises(ValueError, match="cannot join agent episodes and plain samples"):
        concat_samples([b, sample_batch()])
