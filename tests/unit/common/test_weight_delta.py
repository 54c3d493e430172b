"""Delta pushes (``common/weights/delta.py``): the encoding and the digest by hand, then through
the publisher and the real worker-side receive (``FakeServer``: gloo, the worker extension's
``rayless_receive_encoded``): a joiner gets a full push first, a value corrupted in transit
fails that push by name and the server takes nothing but a full push after it."""

from __future__ import annotations

import logging

import pytest
import torch

from common.weights.delta import (
    DIGEST,
    DeltaBase,
    DigestMismatch,
    EncodedWeights,
    digest,
    digest_change,
    encode,
    int_view,
)
from common.weights.gloo import GlooGroup
from common.weights.publisher import WeightPublisher, WeightSyncError
from common.weights.source import ModelWeights
from helpers.rollout_fakes import FakeControl, FakeServer, TinyLM

# --------------------------------------------------------------------------- by hand


def test_digest_by_hand():
    # bf16 1.0 is 0x3F80, -2.0 is 0xC000: bytes 80 3F 00 C0, one int64 word 0xC0003F80 in block 0.
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert int_view(t).tolist() == [16256, -16384]
    assert digest(t).item() == 0xC0003F80 == 3221241728
    # fp32 [0.0, 1.0, 0.0]: 1.0 = 0x3F800000 fills the high half of word 0: 0x3F800000 << 32.
    assert digest(torch.tensor([0.0, 1.0, 0.0])).item() == 0x3F800000 << 32 == 4575657221408423936
    # fp32 -0.0 is 0x80000000 (not 0.0's bits): 2147483648.
    assert digest(torch.tensor([-0.0])).item() == 2147483648
    # Blocks of 512 bytes weigh 1, 2, ...: bf16 1.0 at position 256 (byte 512) is in block 1.
    t = torch.zeros(257, dtype=torch.bfloat16)
    t[256] = 1.0
    assert digest(t).item() == 2 * 16256
    t[256], t[0] = 0.0, 1.0
    assert digest(t).item() == 16256
    assert digest(torch.zeros(0)).item() == 0


def test_digest_change_by_hand_and_against_the_whole_digest():
    # bf16 0.0 -> 1.0 at position 1: 16256 at byte 2 of word 0 (shift 16), block 0.
    idx = torch.tensor([1])
    one, zero = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([0.0], dtype=torch.bfloat16)
    assert digest_change(idx, one, zero).item() == 16256 << 16 == 1065353216
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32, torch.float64, torch.uint8):
        old = (torch.randn(3000, generator=gen) * 50).to(dtype)
        new = old.clone()
        idx = torch.randperm(3000, generator=gen)[:40].sort().values  # across many blocks
        new[idx] = (torch.randn(40, generator=gen) * 50).to(dtype)
        got = digest(old) + digest_change(idx, new[idx], old[idx])
        assert got.item() == digest(new).item(), dtype


def test_encode_sparse_whole_or_nothing_by_bytes():
    old = torch.zeros(8, dtype=torch.bfloat16)
    assert encode("w", old.clone(), old).parts == []  # unchanged: nothing sent
    new = old.clone()
    new[5] = 3.0
    # 1 changed of 8 bf16: sparse costs 1 * (4 + 2) = 6 bytes < 16 whole.
    enc = encode("w", new, old)
    assert enc.changed == 1 and [n for n, _ in enc.parts] == ["w#idx", "w#val"]
    idx, val = enc.parts[0][1], enc.parts[1][1]
    assert idx.dtype == torch.int32 and idx.tolist() == [5]
    assert val.dtype == torch.bfloat16 and val.tolist() == [3.0]
    # 3 changed: 3 * 6 = 18 bytes >= 16: the whole tensor goes.
    new[0], new[7] = 1.0, -1.0
    enc = encode("w", new, old)
    assert enc.changed == 3 and [n for n, _ in enc.parts] == ["w"] and torch.equal(enc.parts[0][1], new)
    # 2 changed: 12 < 16: sparse, positions in order.
    new[7] = 0.0
    assert encode("w", new, old).parts[0][1].tolist() == [0, 5]
    with pytest.raises(ValueError, match="w: cannot encode a change of shape"):
        encode("w", torch.zeros(4), torch.zeros(5))


def test_decode_applies_indices_and_values_and_checks_digests():
    base = DeltaBase()
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([[5.0, 6.0]])
    base.begin("full", {"tied": "a"})
    for name, t in [("a", a), ("b", b), (DIGEST, torch.stack([digest(a), digest(b)]))]:
        base.take(name, t)
    loaded = dict(base.end())
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["tied"], a) and torch.equal(loaded["b"], b)
    # Delta: a[2] = 30, b unchanged (not sent).
    a2 = torch.tensor([1.0, 2.0, 30.0, 4.0])
    base.begin("delta")
    base.take("a#idx", torch.tensor([2], dtype=torch.int32))
    base.take("a#val", torch.tensor([30.0]))
    base.take(DIGEST, torch.stack([digest(a2), digest(b)]))
    assert torch.equal(dict(base.end())["a"], a2)
    # A value corrupted on the way (31 arrives for 30): the digest of "a" differs, the base is gone.
    base.begin("delta")
    base.take("a#idx", torch.tensor([2], dtype=torch.int32))
    base.take("a#val", torch.tensor([31.0]))
    base.take(DIGEST, torch.stack([digest(torch.tensor([1.0, 2.0, 30.0, 4.0])), digest(b)]))
    with pytest.raises(DigestMismatch, match=r"1 of 2 tensors differ .*\(a\)"):
        base.end()
    base.drop()
    # An index corrupted past the end (position 9 of 4): clamped for the scatter, reported at the end.
    base.begin("full")
    for name, t in [("a", a), (DIGEST, torch.stack([digest(a)]))]:
        base.take(name, t)
    base.end()
    base.begin("delta")
    base.take("a#idx", torch.tensor([9], dtype=torch.int32))
    base.take("a#val", torch.tensor([30.0]))
    base.take(DIGEST, torch.stack([digest(a2)]))
    with pytest.raises(DigestMismatch, match="indices outside a;"):
        base.end()
    base.drop()
    with pytest.raises(RuntimeError, match="without a base"):
        base.begin("delta")
    with pytest.raises(ValueError, match="WeightUpdate.encoding: unknown 'sparse'"):
        base.begin("sparse")


def test_encoded_weights_send_the_changes_then_digests_and_keep_a_host_copy():
    model = torch.nn.Linear(4, 2, bias=False)
    src = EncodedWeights(ModelWeights(model), keep=True)
    src.prepare(whole=True)
    assert src.encoding == "full" and [m.name for m in src.metadata()] == ["weight", DIGEST]
    sent = dict(src)
    assert torch.equal(sent["weight"], model.weight.detach()) and sent[DIGEST].tolist() == [digest(model.weight).item()]
    assert src.generation == 1 and torch.equal(src.copy["weight"], model.weight.detach())
    with torch.no_grad():
        model.weight[1, 3] += 1.0
    src.prepare(whole=False)  # 1 of 8 fp32 values: 8 bytes < 32
    assert [m.name for m in src.metadata()] == ["weight#idx", "weight#val", DIGEST]
    sent = dict(src)
    assert sent["weight#idx"].tolist() == [7] and src.stats.changed == 1 and src.stats.values == 8
    assert src.generation == 2 and src.nbytes() == 4 + 4 + 8
    src.prepare(whole=False)  # nothing changed: only the digests travel, the copy is still the base
    assert [m.name for m in src.metadata()] == [DIGEST] and src.generation == 2


# --------------------------------------------------------------------------- through the publisher


def _publisher(model, servers):
    pub = WeightPublisher(
        model, control=FakeControl(servers), backend="gloo", timeout_s=10.0, bucket_bytes=4096, sync="delta"
    )
    for s in servers:
        pub.connect(s.name, workers=1, dtype="float32")
    return pub


def _assert_has(server, model):
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(server.model.loaded[name], p.detach()), (server.name, name)


def _step(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        model.layers[0].weight[0, :3] += torch.randn(3)  # 3 values of one tensor


def test_a_joiner_gets_a_full_push_first_then_deltas_to_all():
    model = TinyLM()
    a, b = FakeServer("a"), FakeServer("b")
    pub = _publisher(model, [a])
    r = pub.push(1)
    assert r.sync.encoding == "full"
    _step(model, 0)
    r = pub.push(2)
    assert r.sync.encoding == "delta" and r.sync.changed == 3 and r.sync.sparse == 1 and r.sync.whole == 0
    # 3 (int32 index, fp32 value) pairs, and an int64 digest for each of the 5 tensors (lm_head is tied)
    assert r.bytes_per_server == 3 * 8 + 5 * 8
    _assert_has(a, model)
    pub.control = FakeControl([a, b])
    pub.connect("b", workers=1, dtype="float32")  # joins: it has no base, so this push is full for both
    _step(model, 1)
    r = pub.push(3)
    assert r.sync.encoding == "full" and sorted(r.updated) == ["a", "b"]
    _assert_has(a, model)
    _assert_has(b, model)
    _step(model, 2)
    r = pub.push(4)
    assert r.sync.encoding == "delta" and r.fleet == ["a", "b"]
    _assert_has(a, model)
    _assert_has(b, model)
    # b left out of a push that changed the copy: it no longer holds the base; the next push is full.
    _step(model, 3)
    assert pub.push(5, ["a"]).sync.encoding == "delta"
    assert pub.push(6).sync.encoding == "full"
    _assert_has(b, model)
    pub.close()


def test_a_value_corrupted_in_transit_fails_that_push_and_only_a_full_push_is_taken_after(monkeypatch, caplog):
    model = TinyLM()
    a = FakeServer("a")
    pub = _publisher(model, [a])
    pub.push(1)
    _step(model, 0)
    corrupt = {"on": True}
    real = GlooGroup.broadcast

    def flip_one_byte(self, tensor, src=0):
        if self.rank == 0 and corrupt["on"] and tensor.numel():
            corrupt["on"] = False
            tensor = tensor.clone()
            tensor[-1] ^= 0x01  # the last byte of the first segment: a value's, or a digest's
        return real(self, tensor, src)

    monkeypatch.setattr(GlooGroup, "broadcast", flip_one_byte)
    with caplog.at_level(logging.ERROR), pytest.raises(WeightSyncError) as err:
        pub.push(2)
    assert "differ from what the learner sent" in err.value.failures["a"]
    assert "serves nothing until a full push lands" in caplog.text
    assert "a" not in pub.links  # its group dropped, as for any failed push
    base = a.engine_worker_base()
    assert base is not None and not base.valid  # the worker's base is gone
    # A delta to it now is refused by the worker; the learner sends it a full push after reconnecting.
    pub.connect("a", workers=1, dtype="float32")
    r = pub.push(3)
    assert r.sync.encoding == "full" and r.updated == ["a"]
    _assert_has(a, model)
    _step(model, 1)
    assert pub.push(4).sync.encoding == "delta"
    _assert_has(a, model)
    pub.close()


def test_delta_refuses_adapter_sync_and_unknown_names():
    with pytest.raises(ValueError, match="unknown weight_sync 'sparse'"):
        WeightPublisher(TinyLM(), sync="sparse")


def test_a_lora_model_pushes_its_merged_weights_as_deltas(tiny_model_dir):
    """--lora_sync merged with --weight_sync delta: the merge W + (alpha/r) B A is what is
    compared, so a change of one adapter weight reaches the servers as the changed values of its
    merged weight alone; the servers end with the merged weights, bit for bit."""
    from common.weights.source import ModelWeights
    from helpers.lora_models import lora_model

    peft_model = lora_model(tiny_model_dir)
    server = FakeServer("s")
    pub = _publisher(peft_model, [server])
    full = pub.push(1)
    layer = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight[0, 0] += 0.5  # row 0 of q_proj's merged weight changes
    r = pub.push(2)
    assert r.sync.encoding == "delta" and r.sync.sparse + r.sync.whole == 1, r.sync
    assert 0 < r.sync.changed <= layer.base_layer.weight.shape[1]  # at most row 0
    assert r.bytes_per_server < full.bytes_per_server / 10
    want = dict(ModelWeights(peft_model, torch.float32))
    assert all(torch.equal(server.model.loaded[n], t) for n, t in want.items())
    pub.close()
