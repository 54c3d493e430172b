"""Token-budget micro-batches against fixed ones on a batch of very uneven lengths, in one run.

One synthetic rollout (``--samples`` samples in groups of 8, prompts of 16-32 random tokens;
responses of ``--short`` tokens for 7 samples in 8 and ``--long`` tokens for the 8th: very
uneven lengths, as a reasoning model's answers are) is trained on by the project's
``PolicyTrainer.step`` on its DeepSpeed engine, one rank, in these variants:

* ``fixed N``: micro-batches of ``--micro_batch`` samples (``--train.micro_batch_size``), the
  default: a micro-batch holding one long answer pads the others to its length;
* ``budget B``: ``--train.dynamic_batch_enable --train.max_tokens_per_gpu B`` (``--max_tokens``):
  micro-batches by tokens, the long answers together, many short ones per forward;

both padded, and with ``--packing`` also packed (``--packing_samples``, one row per micro-batch).
Each variant runs in its own process (a fresh one, so that its peak memory is its own): set-up,
one warm-up step, then ``--iters`` timed steps. Prints per variant the micro-batches a step
runs, the tokens its forwards compute (padding included), the median seconds per step, the
peak memory above the set-up's (CPU: the process's peak resident memory, ``VmHWM``, reset after
set-up; CUDA: ``torch.cuda.max_memory_allocated``), and the budget's ratios to fixed
micro-batches of the same layout (seconds and peak memory; below 1: the budget is better).

Run::

    python bench/dynamic_batch.py                              # small model, padded
    python bench/dynamic_batch.py --packing                    # and packed rows
    python bench/dynamic_batch.py --model tiny --iters 2       # quicker

The loss and gradients are the same in every variant (``tests/unit/rl/test_dynamic_batch.py``);
only the grouping differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench_learner():
    """bench/learner.py (its model builders), by path: as ``learner`` it would hide the package."""
    spec = importlib.util.spec_from_file_location("bench_learner", ROOT / "bench" / "learner.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def uneven_rollout(args, vocab: int):
    import torch

    from learner.controller.types import Rollout, ScoredSample

    rng = random.Random(0)
    samples = []
    for i in range(args.samples):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 32))]
        lo, hi = args.long if i % 8 == 7 else args.short
        response = torch.tensor([rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))], dtype=torch.int32)
        lp = -torch.rand(len(response)) * 5  # vLLM's log-probs: only logged
        samples.append(ScoredSample(i // 8, i % 8, prompt, response, lp, None, rng.random()))
    rng.shuffle(samples)  # the long answers anywhere in the batch, as the rollout servers return them
    return Rollout(samples, 8)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _plan_stats(rollout, cfg) -> tuple[int, int]:
    """(micro-batches, tokens computed) of one step's training pass as the trainer plans it."""
    from learner.algorithms.token_budget import micro_batch_cost
    from learner.rl.micro_batches import plan_micro_batches

    budget = cfg.train.max_tokens_per_gpu if cfg.train.dynamic_batch_enable else 0
    plan = plan_micro_batches(
        rollout.samples,
        range(len(rollout)),
        size=cfg.train.micro_batch_size,
        max_tokens=budget,
        packed=cfg.ds.packing_samples,
    )
    p = [len(s.prompt) for s in rollout.samples]
    r = [len(s.response) for s in rollout.samples]
    return len(plan), sum(micro_batch_cost(p, r, g, cfg.ds.packing_samples) for g in plan)


def child(args) -> None:
    """One variant: set-up, a warm-up step, ``--iters`` timed steps; prints a RESULT line."""
    import torch

    from common.config import build
    from learner.rl.config import PPOConfig
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.runtime import engine as E

    torch.set_num_threads(args.threads)
    info = E.init_distributed()
    E.set_host_malloc("auto")  # the learner's own setting
    path = _bench_learner().model_dir(args.model, Path(args.cache))
    from transformers import AutoConfig

    rollout = uneven_rollout(args, AutoConfig.from_pretrained(path).vocab_size)
    dynamic = dict(use_dynamic_batch=True, train_max_tokens_per_gpu=args.max_tokens) if args.variant_budget else {}
    cfg = build(
        PPOConfig,
        pretrain=str(path),
        prompt_data="-",
        advantage_estimator="group_norm",
        n_samples_per_prompt=8,
        rollout_batch_size=args.samples // 8,
        train_batch_size=args.samples,
        micro_train_batch_size=args.micro_batch,
        micro_rollout_batch_size=args.micro_batch,
        generate_max_len=args.long[1],
        init_kl_coef=0.0,
        actor_learning_rate=1e-6,
        zero_stage=0,
        packing_samples=args.variant_packed,
        **dynamic,
    )
    engine = E.make_engine(
        E.load_causal_lm(str(path)),
        zero_stage=0,
        bf16=False,
        train_batch_size=cfg.train.batch_size,
        micro_train_batch_size=cfg.train.micro_batch_size,
        learning_rate=cfg.actor.adam.lr,
        num_training_steps=1000,
        lr_scheduler="constant_with_warmup",
        lr_warmup_ratio=0.0,
    )
    trainer = PolicyTrainer(engine, cfg, pad_id=0, device=info.device)
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_kb("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory restarts from here
    times = []
    for k in range(args.iters + 1):
        t0 = time.perf_counter()
        trainer.step(rollout, on_policy=True)  # a lockstep rollout: sampled by the current weights
        if cuda:
            torch.cuda.synchronize()
        if k:  # step 0 warms up (the allocator, DeepSpeed's first-step set-up)
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss_kb("VmHWM") * 1024) - base
    micro, tokens = _plan_stats(rollout, cfg)
    real = sum(len(s.prompt) + len(s.response) for s in rollout.samples)
    print("RESULT " + json.dumps(dict(s=statistics.median(times), peak=peak, micro=micro, tokens=tokens, real=real)))


def run_variant(args, *, budget: bool, packed: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
    cmd += ["--variant_budget"] if budget else []
    cmd += ["--variant_packed"] if packed else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(
            f"variant budget={budget} packed={packed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", choices=("tiny", "small", "smollm2"))
    p.add_argument("--samples", type=int, default=64, help="samples per step (one optimizer step), groups of 8")
    p.add_argument("--short", type=int, nargs=2, default=[8, 48], metavar=("LO", "HI"), help="7 answers in 8")
    p.add_argument("--long", type=int, nargs=2, default=[448, 512], metavar=("LO", "HI"), help="the 8th answer")
    p.add_argument("--micro_batch", type=int, default=8, help="samples per micro-batch of the fixed variants")
    p.add_argument("--max_tokens", type=int, default=2048, help="--train.max_tokens_per_gpu of the budget variants")
    p.add_argument("--packing", action="store_true", help="also the packed variants (--packing_samples)")
    p.add_argument("--iters", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--cache", default=str(ROOT / "runs" / "bench"), help="where models are built")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant_budget", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant_packed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        child(args)
        return
    _bench_learner().model_dir(args.model, Path(args.cache))  # built once, before the variants
    rows = []
    for packed in (False, True) if args.packing else (False,):
        fixed = run_variant(args, budget=False, packed=packed)
        budget = run_variant(args, budget=True, packed=packed)
        layout = "packed" if packed else "padded"
        rows += [
            (f"fixed {args.micro_batch}, {layout}", fixed, None),
            (f"budget {args.max_tokens}, {layout}", budget, fixed),
        ]
    real = rows[0][1]["real"]
    print(
        f"model={args.model} samples={args.samples} responses={args.short} (7 in 8) and {args.long} (1 in 8) "
        f"real tokens={real} threads={args.threads} timed steps={args.iters}"
    )
    print(
        f"{'variant':<24}{'micro/step':>11}{'tokens/step':>12}{'s/step':>9}{'peak MB':>9}{'s ratio':>9}{'peak ratio':>11}"
    )
    for name, r, base in rows:
        ratios = f"{r['s'] / base['s']:>9.2f}{r['peak'] / max(base['peak'], 1):>11.2f}" if base else f"{'':>9}{'':>11}"
        print(f"{name:<24}{r['micro']:>11}{r['tokens']:>12}{r['s']:>9.2f}{r['peak'] / 1e6:>9.0f}{ratios}")


if __name__ == "__main__":
    main()
