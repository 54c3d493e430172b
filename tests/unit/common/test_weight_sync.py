"""Weight sync without a vLLM engine: layout, the publisher's fan-out, and failures by name.

The "servers" here are threads running the real worker-side receive loop
(``GlooWeightTransferEngine.receive_weights``, as inside vLLM's workers) on a model that just
records what ``load_weights`` got, behind a fake control channel. The full path through a
real vLLM engine is in ``tests/unit/rollout_service/test_rollout_service.py``.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import Future

import pytest
import torch

from common.weights import SENDERS, resolve_backend, sender_class
from common.weights.publisher import WeightPublisher, WeightSyncError
from common.weights.source import ModelWeights, _layer_runs
from common.weights.wire import ParamMeta, bucket_plan, iter_packed, unpack
from helpers.lora_models import lora_model
from helpers.paths import HELPERS
from helpers.rollout_fakes import FakeControl, FakeServer, TinyLM

# --------------------------------------------------------------------------- layout


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_bucket_plan_matches_vllm_pack_tensors():
    """Our receivers cut buckets with bucket_plan, vLLM's NCCL consumer with its own loop, the
    sender with iter_packed: all three must agree or bytes land in the wrong tensors."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    rng = random.Random(0)
    for trial in range(30):
        tensors = [(f"t{i}", torch.randn(rng.randrange(0, 300))) for i in range(rng.randrange(1, 40))]
        bucket = rng.choice([1, 64, 400, 1000, 10_000])
        it = iter(tensors)
        vllm_chunks = []
        while (chunk := pack_tensors(it, lambda item: item[1], bucket)) is not None:
            vllm_chunks.append(chunk.names)
        plan = bucket_plan([t.numel() * 4 for _, t in tensors], bucket)
        assert [[tensors[i][0] for i in b] for b in plan] == vllm_chunks, trial
        want = [sum(tensors[i][1].numel() * 4 for i in b) for b in plan]
        for segment_bytes in (float("inf"), 100):  # one broadcast per bucket, or big tensors alone
            ours = list(iter_packed(tensors, bucket, segment_bytes=segment_bytes))
            assert [sum(s.numel() for s in segs) for segs in ours] == want


def test_pack_unpack_round_trip_dtypes_views_and_empty():
    base = torch.randn(6, 8)
    tensors = [
        ("bf16", torch.randn(3, 5).to(torch.bfloat16)),
        ("noncontig", base.t()),
        ("empty", torch.zeros(0, 4)),
        ("scalar", torch.tensor(3.5)),
        ("int", torch.arange(7, dtype=torch.int64)),
    ]
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    ((buf,),) = list(iter_packed(tensors, 1 << 20))
    got = unpack(
        buf, [n for n, _ in tensors], [list(t.shape) for _, t in tensors], [t.dtype for _, t in tensors], sizes
    )
    for (name, want), (gname, have) in zip(tensors, got, strict=True):
        assert name == gname and have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have, want.contiguous())


def test_model_weights_lists_tied_names_in_engine_dtype():
    model = TinyLM()
    src = ModelWeights(model, torch.bfloat16)
    meta = src.metadata()
    names = [m.name for m in meta]
    assert "lm_head.weight" in names and "embed_tokens.weight" in names  # tied: both, explicitly
    assert all(m.dtype == torch.bfloat16 for m in meta)
    pairs = list(src)
    assert [n for n, _ in pairs] == names
    assert all(t.dtype == torch.bfloat16 and tuple(t.shape) == m.shape for (_, t), m in zip(pairs, meta, strict=True))
    assert src.nbytes() == sum(t.numel() * 2 for _, t in pairs)
    runs = _layer_runs(list(model.named_parameters(remove_duplicate=False)))
    assert [[n for n, _ in r] for r in runs] == [
        ["embed_tokens.weight"],
        ["layers.0.weight", "layers.0.bias"],
        ["layers.1.weight", "layers.1.bias"],
        ["lm_head.weight"],
    ]


def test_tied_once_sends_the_embedding_once_and_names_the_head_as_its_alias():
    """With a receiver that loads aliases (gloo), the tied lm_head is not sent again: listed
    once under its first name, the other name mapped to it; a push still loads both names."""
    model = TinyLM()
    src = ModelWeights(model, torch.float32, tied_once=True)
    names = [m.name for m in src.metadata()]
    assert "lm_head.weight" not in names and "embed_tokens.weight" in names
    assert src.aliases == {"lm_head.weight": "embed_tokens.weight"}
    embed = model.embed_tokens.weight
    assert src.nbytes() == ModelWeights(model, torch.float32).nbytes() - embed.numel() * 4
    server = FakeServer("s")
    pub = _publisher(model, [server])
    assert pub.source.aliases == src.aliases  # the gloo sender asks for it
    pub.push(1)
    loaded = server.model.loaded
    assert torch.equal(loaded["lm_head.weight"], embed.detach()) and torch.equal(loaded["embed_tokens.weight"], embed)
    pub.close()


def test_unwrap_reaches_the_checkpoint_module_through_wrappers():
    from common.weights.source import unwrap

    lm = TinyLM()
    head = torch.nn.Module()
    head.hf_model = lm  # a reward/value model around an HF model (learner.runtime.models)
    engine = torch.nn.Module()
    engine.module = torch.nn.Module()  # DeepSpeed engine around DDP around the model
    engine.module.module = head
    assert unwrap(engine) is lm and unwrap(lm) is lm and unwrap(head) is lm


# --------------------------------------------------------------------------- backends


def test_registry_resolves_backend_names_and_lists_the_known_ones_for_an_unknown():
    assert resolve_backend("gloo") == "gloo" and resolve_backend("nccl") == "nccl"
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert sender_class("gloo").name == "gloo" and sender_class("nccl").name == "nccl"
    assert sender_class("auto").name == resolve_backend("auto")
    with pytest.raises(ValueError, match=r"unknown weight-transfer backend 'tcp' \(known: auto, gloo, nccl\)"):
        resolve_backend("tcp")
    with pytest.raises(ValueError, match="known: auto, gloo, nccl"):
        WeightPublisher(TinyLM(), backend="tcp")


def test_every_backend_has_a_receiver_in_vllms_registry():
    """A backend added on the learner's side only would fail at the server's start-up."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout_service.weight_receiver import register

    register()
    register()  # idempotent: vLLM may import the worker extension more than once per process
    missing = [name for name in SENDERS if name not in WeightTransferEngineFactory._registry]
    assert not missing, f"no vLLM worker engine registered for {missing}"


# --------------------------------------------------------------------------- fake servers


def _publisher(model, servers, timeout_s=10.0, bucket_bytes=4096, segment_bytes=None):
    pub = WeightPublisher(
        model, control=FakeControl(servers), backend="gloo", timeout_s=timeout_s, bucket_bytes=bucket_bytes
    )
    if segment_bytes is not None:
        pub.segment_bytes = segment_bytes
    for s in servers:
        pub.connect(s.name, workers=1, dtype="float32")
    return pub


@pytest.mark.parametrize("segment_bytes", [None, 512])
def test_push_fans_out_one_pass_to_every_server(segment_bytes):
    model = TinyLM()
    servers = [FakeServer("a"), FakeServer("b")]
    pub = _publisher(model, servers, segment_bytes=segment_bytes)  # 512: bigger tensors go out alone
    passes = []
    pub.source = _Counting(pub.source, passes)
    report = pub.push(7)
    assert sorted(report.updated) == ["a", "b"] and not report.failed and len(passes) == 1
    for s in servers:
        assert s.version == 7
        for name, p in model.named_parameters(remove_duplicate=False):
            assert torch.equal(s.model.loaded[name], p.detach()), (s.name, name)
    with torch.no_grad():
        model.layers[0].weight.add_(1.0)
    pub.push(8, ["b"])
    assert servers[0].version == 7 and servers[1].version == 8
    assert torch.equal(servers[1].model.loaded["layers.0.weight"], model.layers[0].weight.detach())
    assert not torch.equal(servers[0].model.loaded["layers.0.weight"], model.layers[0].weight.detach())
    pub.close()


class _Counting:
    def __init__(self, inner, passes):
        self.inner, self.passes = inner, passes

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __iter__(self):
        self.passes.append(1)
        return iter(self.inner)


@pytest.mark.parametrize("behaviour", ["stall", "die"])
def test_stuck_or_dead_server_is_named_within_the_timeout_others_updated(behaviour):
    model = TinyLM(vocab=2000, dim=64)  # several buckets: the bad peer blocks mid-transfer
    good, bad = FakeServer("good"), FakeServer(f"bad-{behaviour}", behaviour)
    pub = _publisher(model, [good, bad], timeout_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"bad-{behaviour}") as err:
        pub.push(1)
    assert time.monotonic() - t0 < 15
    assert list(err.value.failures) == [bad.name]
    assert err.value.report.updated == ["good"] and good.version == 1
    assert pub.servers == ["good"]  # the broken group is dropped; connect again to retry
    pub.close()


def test_connect_to_a_server_that_never_joins_fails_by_name():
    class Mute(FakeServer):
        def handle(self, msg):
            return Future()  # never answers, never joins

    pub = WeightPublisher(TinyLM(), control=FakeControl([Mute("mute")]), backend="gloo", timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="mute"):
        pub.connect("mute", workers=1)
    assert time.monotonic() - t0 < 10 and pub.servers == []


def test_update_metadata_must_match_iteration():
    model = TinyLM()
    server = FakeServer("s")
    pub = _publisher(model, [server], timeout_s=3.0)
    pub.source.metadata = lambda: [ParamMeta("x", torch.float32, (1,))]
    pub.source.aliases = {}  # (the tied lm_head would name a tensor "x" does not)
    with pytest.raises(ValueError, match="weights changed while sending"):
        pub.push(1)
    assert pub.servers == []  # the group is out of step: dropped
    pub.close()


@pytest.mark.slow
def test_zero3_learner_gathers_on_every_rank_and_rank0_sends(tiny_model_dir):
    """Two DeepSpeed ZeRO-3 ranks (partitioned parameters) push once: both gather each layer,
    rank 0 sends, and the receiver ends up with the full checkpoint, tied lm_head included. The
    model carries LoRA adapters (rank 4, B nonzero, partitioned too): each adapted weight arrives
    as W + (alpha / r) B A, gathered with its adapter; then both ranks save the model and rank 0
    finds the merged weights and the adapter on disk. (A plain ZeRO-3 push is the fleet test's,
    ``test_weight_fleet.py``.)"""
    import json
    import os
    import subprocess
    import sys

    from common.transport import free_port

    script = HELPERS / "rollout_zero3_push.py"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tiny_model_dir), "--lora_rank", "4"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(o[-3000:] for o in outs)
    (line,) = [ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result == {
        "zero3": True,
        "partitioned": True,
        "equal": True,
        "tensors": 27,
        "updated": ["r0"],
        "saved_equal": True,
        "adapter_equal": True,
        # --lora_sync adapter under ZeRO-3: the base as on disk and the adapter, then the adapter
        # alone: 77824 B (rank 4 on every linear layer, half of the rank-8 figure counted by hand
        # in test_adapter_sync_...) over 1970688 B of base (a tied weight once) plus those.
        "adapter_sync": {
            "starts": [False, True],
            "base_equal": True,
            "adapters_equal": [True, True],
            "bytes_second_over_first": round(77824 / (1970688 + 77824), 3),
        },
    }


def test_receive_pool_reuses_a_buffer_only_once_nothing_views_it():
    from rollout_service.weight_receiver_gloo import ReceivePool

    pool = ReceivePool(keep=2)
    a = pool.get(1000)
    held = a[10:20].view(torch.int16)  # as vLLM's layerwise reload holds a loaded weight
    del a
    b = pool.get(800)  # the first buffer is still viewed: a new one
    assert b.untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    del b
    c = pool.get(700)  # the second is free (nothing views it) and big enough: reused, sliced
    assert c.numel() == 700 and pool.reused == 1 and pool.allocated == 2
    del held
    d = pool.get(1000)  # the first is free now too, and big enough
    assert pool.reused == 2 and pool.allocated == 2 and d.untyped_storage().nbytes() == 1000
    del c, d
    pool.get(5000)
    pool.trim()  # the largest `keep` stay between pushes
    assert sorted(b.numel() for b in pool.buffers) == [1000, 5000]


# --------------------------------------------------------------------------- where the stores listen


def test_a_weight_groups_store_listens_only_where_the_servers_are_told_to_connect():
    """A TCPStore of its own would listen on every interface; the learner's listens on its host
    (here loopback) and nowhere else, and the group still forms (one server, in a thread)."""
    import os

    from helpers.listening import listeners

    pub = _publisher(TinyLM(), [FakeServer("a")], timeout_s=10.0)
    store = pub.links["a"].group.store
    assert {lst.host for lst in listeners([os.getpid()]) if lst.port == store.port} == {"127.0.0.1"}
    assert pub.push(1).updated == ["a"]
    pub.close()


@pytest.mark.parametrize(
    ("bind", "sync_host", "expected"),
    [
        ("tcp://127.0.0.1:5555", "", "127.0.0.1"),  # one host: loopback
        ("tcp://localhost:5555", "", "127.0.0.1"),
        ("tcp://10.0.0.5:5555", "", "10.0.0.5"),  # the services reach the controller there already
        ("tcp://0.0.0.0:5555", "", None),  # every interface: the host's name
        ("tcp://*:5555", "", None),
        ("tcp://0.0.0.0:5555", "10.0.0.7", "10.0.0.7"),  # --sync_host wins
    ],
)
def test_sync_host_follows_the_controllers_address(bind, sync_host, expected):
    import socket

    from learner.rl.config.sections import ServicesSection
    from learner.rl.weight_push import _sync_host

    got = _sync_host(ServicesSection(controller_bind=bind, sync_host=sync_host))
    assert got == (socket.gethostname() if expected is None else expected)


# --------------------------------------------------------------------------- LoRA


def test_a_lora_model_is_pushed_merged_under_the_base_names_and_its_weights_stay_untouched(tiny_model_dir):
    """The merged push: base model names (no LoRA tensor on the wire), each adapted weight
    W + (alpha/r) B A -- here alpha/r = 16/8 = 2, computed by hand below -- in fp32 then the
    engine dtype; a plain HF model loaded with what a push delivered gives the PeftModel's
    logits; the trained parameters are bit-identical after the push (nothing merged in place)."""
    from transformers import AutoModelForCausalLM

    peft_model = lora_model(tiny_model_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    src = ModelWeights(peft_model, torch.float32)
    assert [m.name for m in src.metadata()] == [n for n, _ in plain.named_parameters(remove_duplicate=False)]
    assert src.nbytes() == ModelWeights(plain, torch.float32).nbytes()  # the adapter adds no bytes

    server = FakeServer("s")
    pub = _publisher(peft_model, [server])
    pub.push(1)
    pub.close()
    loaded = server.model.loaded
    assert not [n for n in loaded if "lora" in n or "base_layer" in n]
    plain.load_state_dict(loaded, strict=True)
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with torch.no_grad():
        want, got = peft_model(input_ids=ids).logits, plain(input_ids=ids).logits
    assert (want - got).abs().max().item() < 1e-5
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters())

    # By hand, one layer: W + 2 * B @ A, in fp32, then cast once to the engine dtype.
    layer = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    w, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert not torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], w)
    assert torch.allclose(loaded["model.layers.0.self_attn.q_proj.weight"], w + 2.0 * (b @ a), atol=1e-6, rtol=0)
    bf16 = dict(ModelWeights(peft_model, torch.bfloat16))
    assert bf16["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(bf16["model.layers.0.self_attn.q_proj.weight"], (w + 2.0 * (b @ a)).bfloat16())
    assert torch.equal(bf16["model.norm.weight"], peft_model.get_base_model().model.norm.weight.bfloat16())


def test_adapter_sync_sends_the_base_once_then_the_adapter_alone_which_serves_as_the_peft_model(tiny_model_dir):
    """--lora_sync adapter: the first push to a server carries the base weights as they are (not
    merged) and the adapter; later pushes the adapter alone (WeightUpdateStart.adapter_only, no
    weight loaded), which the worker writes as a PEFT folder that, over the base, gives the
    trained PeftModel's logits. A joiner makes the next push carry the base again. The adapter's
    bytes, by hand: rank x (in + out) x 4 per adapted linear layer."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from common import protocol as P
    from common.weights.source import AdapterWeights

    peft_model = lora_model(tiny_model_dir)
    adapter = AdapterWeights(peft_model, torch.float32)
    want = get_peft_model_state_dict(peft_model)  # what peft's save_pretrained writes
    assert sorted(m.name for m in adapter.metadata()) == sorted(want)
    assert all(torch.equal(t, want[n]) for n, t in adapter)
    linear = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert adapter.lora == P.LoraAdapter(rank=8, alpha=16.0, target_modules=linear)
    c = peft_model.config
    h, inter, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + 3 * (h + inter)  # q, k and v, o, gate up and down
    assert adapter.nbytes() == c.num_hidden_layers * per_layer * 8 * 4
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_bytes = ModelWeights(plain, torch.float32, tied_once=True).nbytes()  # gloo sends a tied weight once

    servers = [FakeServer("a"), FakeServer("b")]
    pub = WeightPublisher(
        peft_model, control=FakeControl(servers), backend="gloo", timeout_s=10.0, bucket_bytes=4096, lora_sync="adapter"
    )
    for s in servers:
        pub.connect(s.name, workers=1, dtype="float32")
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])

    def served(server, folder):  # the base a server holds, with the adapter it wrote
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        base.load_state_dict(server.model.loaded, strict=True)
        with torch.no_grad():
            got = PeftModel.from_pretrained(base, str(folder)).eval()(input_ids=ids).logits
            return (got - peft_model(input_ids=ids).logits).abs().max().item()

    r1 = pub.push(1)
    assert r1.bytes_per_server == base_bytes + adapter.nbytes() and sorted(r1.updated) == ["a", "b"]
    for s in servers:
        assert s.starts == [False] and len(s.adapters) == 1
        assert sorted(s.model.loaded) == sorted(n for n, _ in plain.named_parameters(remove_duplicate=False))
        q = peft_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
        assert torch.equal(s.model.loaded["model.layers.0.self_attn.q_proj.weight"], q)  # as it is: not merged
        assert served(s, s.adapters[0]) < 1e-5
    with torch.no_grad():
        peft_model.get_base_model().model.layers[1].mlp.down_proj.lora_B["default"].weight.add_(0.05)
    for s in servers:
        s.model.loaded.clear()  # a weight loaded by the next push would show here
    r2 = pub.push(2)
    assert r2.bytes_per_server == adapter.nbytes() and adapter.nbytes() < base_bytes / 10
    for s in servers:
        assert s.starts == [False, True] and s.model.loaded == {} and s.version == 2 and len(s.adapters) == 2
        s.model.loaded.update(dict(ModelWeights(plain, torch.float32)))  # what it held from push 1
        assert served(s, s.adapters[1]) < 1e-5 and served(s, s.adapters[0]) > 1e-3

    joiner = FakeServer("c")
    pub.control.servers["c"] = joiner
    pub.connect("c", workers=1, dtype="float32")
    r3 = pub.push(3)
    assert sorted(r3.updated) == ["a", "b", "c"] and r3.bytes_per_server == base_bytes + adapter.nbytes()
    assert [s.starts[-1] for s in (*servers, joiner)] == [False, False, False]
    assert served(joiner, joiner.adapters[0]) < 1e-5
    assert pub.push(4).bytes_per_server == adapter.nbytes()
    pub.close()


def test_adapter_sync_refuses_what_vllm_would_not_serve_by_name(tiny_model_dir):
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from common.weights.source import AdapterWeights

    def wrapped(**kw):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **kw))

    with pytest.raises(ValueError, match="serves plain LoRA on linear layers; this model has use_dora"):
        AdapterWeights(wrapped(use_dora=True))
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'\]"):
        AdapterWeights(wrapped(modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="the model has no LoRA adapter"):
        AdapterWeights(SimpleNamespace())
    assert AdapterWeights(wrapped()).lora.target_modules == ["q_proj"]
