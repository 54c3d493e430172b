"""One DeepSpeed ZeRO training step on a model dir, on CPU (gloo); print a JSON result line.

Run as a single rank, with the env torchrun would set (MASTER_ADDR, MASTER_PORT, RANK,
LOCAL_RANK, WORLD_SIZE):
    python tests/helpers/deepspeed_step.py MODEL_DIR --stage 2|3
Output: a line `RESULT {...}` with the loss, how far the weights moved, and for stage 3
whether the parameters were partitioned at load and matched the checkpoint once gathered.

Uses torch's AdamW (`torch_adam: true`): DeepSpeedCPUAdam would JIT-compile a C++ op first
(20-55 s on 2 cores), which is not what this smoke test is about.
"""

import argparse
import json


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--stage", type=int, choices=(2, 3), required=True)
    args = p.parse_args()

    import deepspeed
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import HfDeepSpeedConfig

    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    config = ds_config(args.stage)
    on_disk = load_file(f"{args.model}/model.safetensors")["model.embed_tokens.weight"]

    result = {"stage": args.stage}
    # ZeRO-3: transformers must see the DeepSpeed config *before* from_pretrained, so the
    # model is built under zero.Init and each rank loads only its shards. Keep a reference:
    # transformers holds it weakly.
    hf_ds_config = HfDeepSpeedConfig(config) if args.stage == 3 else None  # noqa: F841
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    embed = model.model.embed_tokens.weight
    if args.stage == 3:
        result["partitioned"] = hasattr(embed, "ds_id") and embed.numel() == 0
        with deepspeed.zero.GatheredParameters([embed]):
            result["loaded_matches_checkpoint"] = bool(torch.equal(embed.detach(), on_disk))
    else:
        result["loaded_matches_checkpoint"] = bool(torch.equal(embed.detach(), on_disk))

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    result["optimizer"] = type(engine.optimizer).__name__
    result["inner_optimizer"] = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__

    tok = AutoTokenizer.from_pretrained(args.model)
    batch = tok(["What is 2 + 3? Answer: 5", "Reverse the string: abc. Answer: cba"], return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    losses = []
    for _ in range(2):  # step, then measure the loss again on the same batch
        loss = engine(**batch, labels=labels).loss
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    result["losses"] = losses

    embed = engine.module.model.embed_tokens.weight
    lm_head = engine.module.lm_head.weight
    with deepspeed.zero.GatheredParameters([embed, lm_head], enabled=args.stage == 3):
        result["embed_max_change"] = (embed.detach() - on_disk).abs().max().item()
        result["still_tied"] = bool(torch.equal(embed.detach(), lm_head.detach()))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
