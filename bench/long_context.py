"""Tiled log-probs against whole logits at growing response lengths, in one run: peak memory and
time of one training step, and the longest response that trains under a fixed memory cap.

The model is of the tiny family (``common.tiny``'s tokenizer, a random Qwen2) made wide in
vocabulary (``--vocab``, default 65536: the scale of real LMs' 49k-152k) and otherwise small (2
layers x 256), so that the logits, not the layers' activations, are what memory holds. One
rollout of ``--samples`` samples (one group, one micro-batch: one optimizer step) with prompts of
16 random tokens and responses of ``L`` random tokens is trained on by the project's
``PolicyTrainer.step`` on its DeepSpeed engine (ZeRO-0, fp32, one rank, on-policy: the step is
the training forward and backward), for each ``L`` of ``--lengths`` in two variants:

* ``whole``: ``--ds.logits_tile_tokens 0``, the micro-batch's (tokens x V) logits at once (the
  head already projects only the response columns, ``logits_to_keep``);
* ``tiled``: ``--ds.logits_tile_tokens --tile`` (``common.tiled_logits``);
* ``split``: tiled, and each sequence split over ``--split`` ranks (``--ds.ring_attn_size``,
  ``learner.runtime.sequence_parallel``), one sequence-parallel group started by torchrun; its peak
  and time are the largest of its ranks' (what each rank needs under the same cap).

Each (variant, L) runs in a fresh process: set-up, one warm-up step, ``--iters`` timed steps. Peak
memory is the process's peak resident memory (``VmHWM``) over the steps minus its resident memory
after set-up (the model, the optimizer, torch and DeepSpeed), with the learner's own allocator
setting (``--host_malloc auto``: freed host memory kept for reuse, as the learner runs): what the
step adds at its worst, as the OS sees it, allocator caching included. A variant stops growing L
once its peak passes ``--cap_mb``; the longest L under the cap is reported per variant and their
ratio (goal of issue 41: tiled at least 2x whole's length). Time: the median CPU seconds of the
process per step (``time.process_time``: one torch thread, so the work done, which a busy shared
host does not inflate as it does wall time, seen 2-4x apart between runs) and the tiled/whole
ratio at each L both ran; on CUDA, wall seconds.

Run::

    python bench/long_context.py                           # the default ladder (512-4096), cap 2048 MB
    python bench/long_context.py --lengths 512 1024 --iters 1 --cap_mb 1024   # quicker
    python bench/long_context.py --tile 256 --variants tiled --lengths 8192 16384   # tiled's limit
    python bench/long_context.py --variants tiled split --lengths 1024 2048 4096 8192 --cap_mb 1024 --iters 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("whole", "tiled", "split")


def model_dir(args) -> Path:
    out = Path(args.cache) / f"wide_v{args.vocab}"
    if not (out / "config.json").is_file():
        import torch
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        from common.tiny import build_tiny_model

        tiny = build_tiny_model(Path(args.cache) / "tiny")
        torch.manual_seed(0)
        config = Qwen2Config(
            vocab_size=args.vocab,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=65536,
            tie_word_embeddings=True,
            pad_token_id=0,
        )
        Qwen2ForCausalLM(config).save_pretrained(out)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def _rollout(args, length: int):
    import torch

    from learner.controller.types import Rollout, ScoredSample

    rng = random.Random(0)
    samples = []
    for i in range(args.samples):
        prompt = [rng.randrange(3, args.vocab) for _ in range(16)]
        response = torch.tensor([rng.randrange(3, args.vocab) for _ in range(length)], dtype=torch.int32)
        lp = -torch.rand(length) * 5  # vLLM's log-probs: only logged
        samples.append(ScoredSample(0, i, prompt, response, lp, None, float(i % 2)))
    return Rollout(samples, args.samples)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(args) -> None:
    """One (variant, length): set-up, a warm-up step, ``--iters`` timed steps; prints a RESULT line."""
    import torch

    from common.config import build
    from learner.rl.config import PPOConfig
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.runtime import engine as E

    torch.set_num_threads(args.threads)
    info = E.init_distributed()
    E.set_host_malloc("auto")  # the learner's own setting
    path = model_dir(args)
    cfg = build(
        PPOConfig,
        pretrain=str(path),
        prompt_data="-",
        advantage_estimator="group_norm",
        n_samples_per_prompt=args.samples,
        rollout_batch_size=1,
        train_batch_size=args.samples,
        micro_train_batch_size=args.samples,
        micro_rollout_batch_size=args.samples,
        generate_max_len=args.length,
        init_kl_coef=0.0,
        actor_learning_rate=1e-6,
        zero_stage=0,
        logits_tile_tokens=args.variant_tile,
        ring_attn_size=info.world_size,  # the split variant's ranks are one sequence-parallel group
    )
    engine = E.make_engine(
        E.load_causal_lm(str(path)),
        zero_stage=0,
        bf16=False,
        # as learner.rl.build gives it: DeepSpeed counts every rank as data parallel, so with the split its
        # batch is the group's size x the train batch
        train_batch_size=cfg.train.batch_size * info.world_size,
        micro_train_batch_size=cfg.train.micro_batch_size,
        learning_rate=cfg.actor.adam.lr,
        num_training_steps=1000,
        lr_scheduler="constant_with_warmup",
        lr_warmup_ratio=0.0,
    )
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=info.device)
    rollout = _rollout(args, args.length)
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_kb("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory restarts from here
    clock = time.perf_counter if cuda else time.process_time
    times = []
    for k in range(args.iters + 1):
        t0 = clock()
        trainer.step(rollout, on_policy=True)
        if cuda:
            torch.cuda.synchronize()
        if k:  # step 0 warms up (the allocator, DeepSpeed's first-step set-up)
            times.append(clock() - t0)
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss_kb("VmHWM") * 1024) - base
    for rank in range(info.world_size):  # one line at a time: the split's ranks share torchrun's stdout
        if rank == info.rank:
            print("RESULT " + json.dumps(dict(s=statistics.median(times), peak=peak)), flush=True)
        if info.world_size > 1:
            torch.distributed.barrier()


def run_case(args, tile: int, length: int, ranks: int = 1) -> dict:
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = [*launch, __file__, "--child", *sys.argv[1:], "--variant_tile", str(tile), "--length", str(length)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [json.loads(x[len("RESULT ") :]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or len(lines) != ranks:
        raise SystemExit(f"tile={tile} length={length} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"s": max(r["s"] for r in lines), "peak": max(r["peak"] for r in lines)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=65536, help="vocabulary of the wide tiny model")
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[512, 768, 1024, 1536, 2048, 3072, 4096],
        help="response lengths, rising",
    )
    p.add_argument("--samples", type=int, default=2, help="samples per step (one group, one micro-batch)")
    p.add_argument("--tile", type=int, default=256, help="--ds.logits_tile_tokens of the tiled variant (its default)")
    p.add_argument("--cap_mb", type=float, default=2048, help="the memory cap: peak MB above the set-up's")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["whole", "tiled"],
        choices=VARIANTS,
        help="which variants to run (split: tiled with the sequence split over --split ranks)",
    )
    p.add_argument("--split", type=int, default=2, help="ranks the split variant splits each sequence over")
    p.add_argument("--iters", type=int, default=2, help="timed steps per case (after one warm-up step)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--cache", default=str(ROOT / "runs" / "bench"), help="where models are built")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant_tile", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        child(args)
        return
    model_dir(args)  # built once, before the cases
    print(
        f"vocab={args.vocab} samples={args.samples} (one micro-batch) tile={args.tile} cap={args.cap_mb:.0f} MB "
        f"threads={args.threads} timed steps={args.iters}",
        flush=True,
    )
    split = f"split{args.split}"
    print(
        f"{'response':>9}{'whole s':>9}{'whole MB':>10}{'tiled s':>9}{'tiled MB':>10}{'s ratio':>9}{'MB ratio':>10}"
        f"{split + ' s':>10}{split + ' MB':>11}"
    )
    print(
        f"{'(tokens)':>9}{'(cpu)':>9}{'(peak)':>10}{'(cpu)':>9}{'(peak)':>10}{'':>19}{'(cpu)':>10}{'(rank peak)':>11}"
    )
    longest = dict.fromkeys(VARIANTS, 0)
    over = {name: name not in args.variants for name in VARIANTS}  # a variant not run: as if over
    for length in args.lengths:
        row = {}
        for name, tile, ranks in (("whole", 0, 1), ("tiled", args.tile, 1), ("split", args.tile, args.split)):
            if over[name]:
                continue
            r = row[name] = run_case(args, tile, length, ranks)
            if r["peak"] / 2**20 <= args.cap_mb:
                longest[name] = length
            else:
                over[name] = True
        cells = ""
        for name in ("whole", "tiled"):
            r = row.get(name)
            cells += f"{r['s']:>9.2f}{r['peak'] / 2**20:>10.0f}" if r else f"{'-':>9}{'-':>10}"
        if "whole" in row and "tiled" in row:
            cells += (
                f"{row['tiled']['s'] / row['whole']['s']:>9.2f}{row['tiled']['peak'] / row['whole']['peak']:>10.2f}"
            )
        else:
            cells += f"{'':>19}"
        r = row.get("split")
        cells += f"{r['s']:>10.2f}{r['peak'] / 2**20:>11.0f}" if r else f"{'-':>10}{'-':>11}"
        print(f"{length:>9}{cells}", flush=True)
        if all(over.values()):
            break
    said = []
    for name in args.variants:
        top = " (the ladder's top: --lengths longer to find its limit)" if not over[name] else ""
        said.append(f"{name} {longest[name]}{top}")
    line = f"longest response under {args.cap_mb:.0f} MB: " + ", ".join(said)
    if "whole" in args.variants and "tiled" in args.variants and longest["whole"]:
        line += f"; tiled/whole {longest['tiled'] / longest['whole']:.1f}x"
    if "split" in args.variants and "tiled" in args.variants and longest["tiled"]:
        line += f"; {split}/tiled {longest['split'] / longest['tiled']:.1f}x"
    print(line)


if __name__ == "__main__":
    main()
