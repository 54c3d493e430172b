"""One weight push from a 2-rank DeepSpeed ZeRO-3 learner to an in-process rollout stand-in.

Run once per rank with the env torchrun would set (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK,
WORLD_SIZE):  python tests/helpers/rollout_zero3_push.py MODEL_DIR
Every rank builds a WeightPublisher on its DeepSpeed engine and calls push(): each layer is
gathered on both ranks (a collective), rank 0 sends. Rank 0 prints `RESULT {...}`: whether
every tensor the receiver loaded equals the checkpoint's full tensor.

``--lora_rank R``: the model is a peft LoRA model (every linear layer but the head, B drawn
nonzero, the adapters partitioned by DeepSpeed like the base): the receiver must get
``W + (alpha / r) B A`` for each adapted weight, the others as on disk; then both ranks save it
(``learner.runtime.engine.save_hf``) and rank 0 checks the merged model and the adapter written;
then a publisher with ``lora_sync="adapter"`` pushes twice to a new receiver: the base weights as
on disk and the adapter first (every rank told by rank 0 that the base goes too), the adapter
alone next (``adapter_sync`` in the result).
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    # More than one server: the push goes through the fleet group; --bad die makes the last one
    # fail in it, so rank 0 retries the others in a second pass that every rank must follow.
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--bad", default="", choices=["", "die"])
    # The publisher's timeout: a dead peer in the relay is found when it runs out.
    p.add_argument("--timeout_s", type=float, default=60.0)
    p.add_argument("--lora_rank", type=int, default=0)
    # --weight_sync delta: push, change a weight on every rank, push again (a delta).
    p.add_argument("--sync", default="full", choices=["full", "delta"])
    args = p.parse_args()

    import deepspeed
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from common.weights.publisher import WeightPublisher, WeightSyncError
    from helpers.rollout_fakes import FakeControl, FakeServer

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 1_000_000,
    }
    hf_ds_config = HfDeepSpeedConfig(config)  # noqa: F841  (must outlive from_pretrained)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    adapters: dict[str, torch.Tensor] = {}  # peft name -> the value every rank starts from
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
        model = get_peft_model(model, lora)
        torch.manual_seed(0)  # the same adapters on both ranks
        with torch.no_grad():
            for n, q in model.named_parameters():
                if ".lora_" in n:
                    q.normal_(0.0, 0.05)  # B nonzero: the merge changes every adapted weight
                    adapters[n] = q.detach().clone()
    trained = [q for q in model.parameters() if q.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=config)

    servers = (
        [FakeServer(f"r{i}", args.bad if args.bad and i == args.servers - 1 else "ok") for i in range(args.servers)]
        if rank == 0
        else []
    )
    server = servers[0] if servers else None

    def publisher(to: list[FakeServer], lora_sync: str = "merged", sync: str = "full") -> WeightPublisher:
        """A publisher of this engine (the servers ``to`` on rank 0), connected to them."""
        made = WeightPublisher(
            engine,
            control=FakeControl(to) if rank == 0 else None,
            rank=rank,
            backend="gloo",
            bucket_bytes=256 * 1024,
            timeout_s=args.timeout_s,
            lora_sync=lora_sync,
            sync=sync,
        )
        for s in to:
            made.connect(s.name, workers=1, dtype="float32")
        return made

    if args.sync == "delta":
        _delta(engine, publisher(servers, sync="delta"), servers, rank)
        return
    pub = publisher(servers)
    partitioned = all(p.numel() == 0 for _, p in pub.source._params) and all(
        q.numel() == 0 for n, q in engine.module.named_parameters() if ".lora_" in n
    )
    try:
        report = pub.push(1)
    except WeightSyncError as e:
        report = e.report
    if rank == 0 and args.servers > 1:
        disk = load_file(f"{args.model}/model.safetensors")
        disk.setdefault("lm_head.weight", disk["model.embed_tokens.weight"])
        good = [s for s in servers if s.behaviour == "ok"]
        same = all(sorted(s.model.loaded) == sorted(disk) for s in good) and all(
            torch.equal(s.model.loaded[k], disk[k]) for s in good for k in disk
        )
        fleet = {"equal": same, "updated": sorted(report.updated), "failed": sorted(report.failed)}
        print("FLEET " + json.dumps({**fleet, "fleet": report.fleet, "retried": report.retried}), flush=True)
        pub.close()
    elif rank == 0:
        disk = load_file(f"{args.model}/model.safetensors")
        disk.setdefault("lm_head.weight", disk["model.embed_tokens.weight"])  # tied: not saved twice
        want = _merged(disk, adapters, 2.0) if args.lora_rank else disk
        loaded = server.model.loaded
        same = sorted(loaded) == sorted(want) and all(_close(loaded[k], want[k]) for k in want)
        result = {
            "zero3": pub.source.zero3,
            "partitioned": partitioned,
            "equal": same,
            "tensors": len(loaded),
            "updated": report.updated,
        }
        if not args.lora_rank:
            print("RESULT " + json.dumps(result), flush=True)
        pub.close()
    if args.lora_rank:  # the save: every rank gathers, rank 0 writes
        import tempfile

        from learner.runtime.engine import save_hf

        out = Path(tempfile.mkdtemp(prefix="zero3-lora-")) if rank == 0 else Path("unused")
        save_hf(engine, None, out)
        if rank == 0:
            saved = load_file(out / "model.safetensors")
            saved.setdefault("lm_head.weight", saved["model.embed_tokens.weight"])
            adapter = load_file(out / "adapter" / "adapter_model.safetensors")
            result["saved_equal"] = sorted(saved) == sorted(want) and all(_close(saved[k], want[k]) for k in want)
            result["adapter_equal"] = sorted(adapter) == sorted(n.replace(".default", "") for n in adapters) and all(
                torch.equal(adapter[n.replace(".default", "")], t) for n, t in adapters.items()
            )
        # --lora_sync adapter: a learner of its own kind (its publisher), a receiver of its own.
        fresh = [FakeServer("ra")] if rank == 0 else []
        apub = publisher(fresh, lora_sync="adapter")
        first = apub.push(2)
        second = apub.push(3)
        if rank == 0:
            (ra,) = fresh
            peft_names = {n.replace(".default", ""): t for n, t in adapters.items()}

            def folder_equal(folder) -> bool:
                got = load_file(folder / "adapter_model.safetensors")
                return sorted(got) == sorted(peft_names) and all(torch.equal(got[n], t) for n, t in peft_names.items())

            loaded = ra.model.loaded
            result["adapter_sync"] = {
                "starts": ra.starts,  # adapter_only per push
                "base_equal": sorted(loaded) == sorted(disk) and all(torch.equal(loaded[k], disk[k]) for k in disk),
                "adapters_equal": [folder_equal(f) for f in ra.adapters],
                "bytes_second_over_first": round(second.bytes_per_server / first.bytes_per_server, 3),
            }
            apub.close()
            print("RESULT " + json.dumps(result), flush=True)
    # Both ranks leave together, and without the interpreter's teardown: after a push in which a
    # server died on purpose, destroying the gloo groups whose pairs that death broke can abort a
    # rank in gloo's C++ destructors ("terminate called without an active exception", exit code
    # -6; seen twice under CI load, in rank 1, after the work was done and checked). What this
    # helper reports is the push. Whether a learner's own exit after a failed fleet push can
    # abort the same way is not examined here.
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _delta(engine, pub, servers, rank: int) -> None:
    """A full push, a change of three values of one weight (made on rank 0 inside a gather, as
    an optimizer step would leave it on every rank's shard), then a delta push: every rank
    gathers in the same order (the delta's encode pass), rank 0's servers end with the new
    weights. Prints DELTA {json} on rank 0."""
    import deepspeed
    import torch

    first = pub.push(1)
    weight = engine.module.model.layers[0].mlp.up_proj.weight
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
        if rank == 0:
            weight[0, :3] += 1.0
    second = pub.push(2)
    want = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):  # a collective: every rank
            want[name] = p.detach().clone()
    if rank == 0:
        same = all(torch.equal(s.model.loaded[n], t) for s in servers for n, t in want.items())
        out = {
            "encodings": [first.sync.encoding, second.sync.encoding],
            "changed": second.sync.changed,
            "updated": sorted(second.updated),
            "fleet": second.fleet,
            "equal": same,
        }
        print("DELTA " + json.dumps(out), flush=True)
        pub.close()
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _merged(disk: dict, adapters: dict, scale: float) -> dict:
    """The checkpoint with ``W + scale * B @ A`` for every adapted weight (peft names -> plain)."""
    out = dict(disk)
    for n, a in adapters.items():
        if ".lora_A." not in n:
            continue
        b = adapters[n.replace(".lora_A.", ".lora_B.")]
        plain = n.removeprefix("base_model.model.").replace(".lora_A.default.weight", ".weight")
        out[plain] = disk[plain] + scale * (b @ a)
    return out


def _close(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-6, rtol=0))


if __name__ == "__main__":
    main()
