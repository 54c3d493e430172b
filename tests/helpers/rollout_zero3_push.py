"""One weight push from a 2-rank DeepSpeed ZeRO-3 learner to an in-process rollout stand-in.

Run once per rank with the env torchrun would set (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK,
WORLD_SIZE):  python tests/helpers/rollout_zero3_push.py MODEL_DIR
Every rank builds a WeightPublisher on its DeepSpeed engine and calls push(): each layer is
gathered on both ranks (a collective), rank 0 sends. Rank 0 prints `RESULT {...}`: whether
every tensor the receiver loaded equals the checkpoint's full tensor.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    args = p.parse_args()

    import deepspeed
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from common.weights.publisher import WeightPublisher
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
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    server = FakeServer("r0") if rank == 0 else None
    pub = WeightPublisher(
        engine,
        control=FakeControl([server]) if server else None,
        rank=rank,
        backend="gloo",
        bucket_bytes=256 * 1024,
        timeout_s=60,
    )
    partitioned = all(p.numel() == 0 for _, p in pub.source._params)
    if rank == 0:
        pub.connect("r0", workers=1, dtype="float32")
    report = pub.push(1)
    if rank == 0:
        disk = load_file(f"{args.model}/model.safetensors")
        disk.setdefault("lm_head.weight", disk["model.embed_tokens.weight"])  # tied: not saved twice
        loaded = server.model.loaded
        same = sorted(loaded) == sorted(disk) and all(torch.equal(loaded[k], disk[k]) for k in disk)
        print(
            "RESULT "
            + json.dumps(
                {
                    "zero3": pub.source.zero3,
                    "partitioned": partitioned,
                    "equal": same,
                    "tensors": len(loaded),
                    "updated": report.updated,
                }
            ),
            flush=True,
        )
        pub.close()
    # Both ranks leave together and take their process group down themselves: a rank exiting
    # with the group alive while its peer still talks to it can abort in gloo's teardown
    # ("terminate called without an active exception", seen once under CI load).
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
