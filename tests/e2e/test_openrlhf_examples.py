"""OpenRLHF 0.10's example scripts run on CPU with only the launcher line and these tokens changed.

The scripts' argv are checked in (``tests/unit/structure/openrlhf_0_10_examples.json``, read from
OpenRLHF at 3c3be62; ``test_openrlhf_flags.py`` parses them). Here each RUNS: ``ray job submit ...
python3 -m openrlhf.cli.X`` becomes rayless's module (``learner.train_ppo`` through
``launch.local``, ``learner.train_sft`` / ``train_rm`` / ``train_dpo``, ``reward_service.serve_rm``)
and ``rewrite`` changes only these tokens of the argv, saying each change in the test's output:

- models (hub names) -> the session's tiny model; a reward model -> a tiny one made from it;
- data (hub names, OpenRLHF's own example files) -> small local files written in the shape the
  example's keys ask for (``--data.input_key`` / ``label_key`` / ``output_key`` / ``chosen_key``
  ...); the reward function and agent files -> the tests' first-char-parity function (the one the
  shared fleet serves) and the e2e agent file, both written for OpenRLHF's contract;
- absolute output paths (``/openrlhf/...``, ``//exp/...``) -> the test's folder (relative ones are
  kept: every run starts in its test's folder);
- sizes -> a couple of steps of a few samples (``SIZES``), and the flags added: a step cap,
  ``--train.max_steps 2`` for PPO, and ``--rollout.max_new_tokens 8`` where a PPO example leaves
  it at its default (1024); the supervised runs stop by their data (8 rows, batches of 4);
- GPU counts (Ray's placement flags, ``--vllm.num_engines``, tensor parallel, the sequence split
  ``--ds.ring_attn_size``) -> this host's;
- GPU-only switches the CPU cannot take -> dropped, by ``drop_gpu_only`` (the list is there).

Everything else passes as the script has it: colocation and both sleep flags, bf16, FlashAttention,
ZeRO-3, packing, gradient checkpointing, dynamic batching, the wandb key placeholder (wandb runs
offline here): on CPU those that cannot act say so at start-up, and the run goes on.

The PPO examples join the session's shared fleet: its two rollout servers (vLLM) serve them all.
Every one of them has KL on (a reference model), which the fleet's reward service (the parity
function alone) does not serve, so each run swaps that service -- a few seconds, no vLLM -- for
the one ``launch.local`` would start from the example's own flags (function or reward model, plus
the reference), and the module puts the fleet's back at its end: five learner runs of two steps,
no engine start. The async agent example is refused by design (colocated and async contradict each
other): its start-up must say so. The supervised examples run two optimizer steps each, serve_rm's
scores one request. OpenRLHF's Slurm example is not among the checked-in argv (it starts Ray
itself; ``launch/grpo_70b.slurm`` is rayless's counterpart, run by ``make test-slurm``).
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.e2e_launch import AGENT_EXAMPLE, PARITY_REWARD, cpu_env, finish, local_cmd, metrics, start
from helpers.paths import HELPERS, ROOT
from helpers.procs import worker_env
from helpers.shared_fleet import ROLLOUTS
from helpers.wandb_offline import offline_env

pytestmark = pytest.mark.slow

EXAMPLES_JSON = ROOT / "tests" / "unit" / "structure" / "openrlhf_0_10_examples.json"
EXAMPLES: dict[str, dict] = json.loads(EXAMPLES_JSON.read_text())
MODULES = {  # OpenRLHF's command -> rayless's module
    "train_ppo_ray": "learner.train_ppo",
    "train_sft": "learner.train_sft",
    "train_rm": "learner.train_rm",
    "train_dpo": "learner.train_dpo",
    "serve_rm": "reward_service.serve_rm",
}


def _refused() -> dict[str, str]:
    """What rayless refuses on purpose: script -> what its start-up says (test_openrlhf_flags.py's
    REFUSED, which says why)."""
    path = EXAMPLES_JSON.with_name("test_openrlhf_flags.py")
    spec = importlib.util.spec_from_file_location("openrlhf_flags_refused", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.REFUSED)


REFUSED = _refused()
PPO = sorted(s for s, e in EXAMPLES.items() if e["command"] == "train_ppo_ray" and s not in REFUSED)
SUPERVISED = sorted(s for s, e in EXAMPLES.items() if e["command"] in ("train_sft", "train_rm", "train_dpo"))

STEPS = 2  # PPO: --train.max_steps; supervised: 8 rows in batches of 4
FLEET_SERVERS = len(ROLLOUTS)  # the shared fleet's rollout servers
PARITY_FILE = HELPERS / "reward_first_char_parity.py"


# ------------------------------------------------------------------------------ the rewrite


def groups(argv: list[str]) -> list[list[str]]:
    """The argv as [flag, value...] groups (a value never starts with ``--``)."""
    out: list[list[str]] = []
    for a in argv:
        if a.startswith("--"):
            out.append([a])
        else:
            out[-1].append(a)
    return out


# Switches that need a GPU and that a CPU host refuses outright (others that cannot act on CPU --
# bf16 runs there, FlashAttention falls back to SDPA, the sleep flags and the memory share do
# nothing -- are rayless's to explain at start-up, so they stay). flag -> (value, why).
GPU_ONLY = {
    "--vllm.sync_backend": ("nccl", "NCCL needs CUDA devices; without the flag the push picks gloo on CPU (auto)"),
}


def drop_gpu_only(argv: list[str], *, cuda: bool) -> tuple[list[str], list[str]]:
    """GPU-only switches are dropped on CPU: ``GPU_ONLY``'s flags with its value, on a host
    without CUDA. Returns (argv, what was dropped and why)."""
    if cuda:
        return argv, []
    kept, dropped = [], []
    for g in groups(argv):
        rule = GPU_ONLY.get(g[0])
        if rule and g[1:] == [rule[0]]:
            dropped.append(f"{shlex.join(g)} ({rule[1]})")
        else:
            kept += g
    return kept, dropped


@dataclass
class Local:
    """What the rewrite puts in: the local models and files, and where a run writes."""

    policy: str
    rm: str = ""
    data: str = ""
    eval_data: str = ""
    run: Path = Path()
    port: int = 0


# Sizes: flag -> its value here (a function of the example's value and its argv where it must be).
# PPO: each step samples at least 8 (the default micro-batch, which an example may leave unset),
# from 2 prompts or more; one optimizer step per rollout step. Supervised: batches of 4.
MIN_SAMPLES, SUPERVISED_BATCH = 8, 4


def _n(argv: list[str]) -> int:
    g = [g for g in groups(argv) if g[0] == "--rollout.n_samples_per_prompt"]
    return int(g[0][1]) if g else 1


def _prompts(argv: list[str]) -> int:
    return max(2, MIN_SAMPLES // _n(argv))


def _batch(argv: list[str]) -> int:
    """The train batch: a PPO step's samples, or the supervised batch."""
    return _prompts(argv) * _n(argv) if "--rollout.batch_size" in argv else SUPERVISED_BATCH


SIZES = {
    "--rollout.batch_size": lambda v, argv: _prompts(argv),
    "--train.batch_size": lambda v, argv: _batch(argv),
    "--train.micro_batch_size": lambda v, argv: min(int(v), _batch(argv)),
    "--rollout.micro_batch_size": lambda v, argv: min(int(v), _batch(argv)),
    "--data.max_len": lambda v, argv: 64,
    "--rollout.max_new_tokens": lambda v, argv: 8,
    "--data.max_samples": lambda v, argv: 32 if "--rollout.batch_size" in argv else 8,
    "--train.num_episodes": lambda v, argv: 1,
    "--train.max_epochs": lambda v, argv: 1,
    "--ckpt.save_steps": lambda v, argv: v if int(v) < 0 else STEPS,
    "--eval.steps": lambda v, argv: v if int(v) < 0 else STEPS,
    "--batch_size": lambda v, argv: 4,  # serve_rm's micro-batch
}


# The sequence split counts learner ranks: the examples' one learner rank here cannot split by 2.
GPU_COUNTS = ("--vllm.tensor_parallel_size", "--vllm.num_engines", "--ds.ring_attn_size")


def kind(flag: str, values: list[str]) -> str:
    """Which kind of token the rewrite makes local ("" for a flag passed as the script has it)."""
    if flag.endswith(".model_name_or_path"):
        return "model"
    if flag in ("--data.prompt_dataset", "--data.dataset", "--eval.dataset", "--train.agent_func_path"):
        return "data"
    if flag == "--reward.remote_url" and values[0].endswith(".py"):
        return "data"  # OpenRLHF's example reward function file
    if flag in ("--ckpt.output_dir", "--ckpt.path", "--logger.tensorboard_dir") and values[0].startswith("/"):
        return "output path"
    if flag in SIZES:
        return "size"
    if flag.endswith((".num_nodes", ".num_gpus_per_node")) or flag in GPU_COUNTS:
        return "GPU count"
    if flag == "--port":
        return "port"  # serve_rm: a free port, not 5000 on a shared host
    return ""


def local_values(flag: str, values: list[str], argv: list[str], local: Local) -> list[str]:
    """The local stand-in for a flag of a rewritten ``kind``."""
    fixed = {
        "--actor.model_name_or_path": local.policy,
        "--model.model_name_or_path": local.policy,
        "--reward.model_name_or_path": local.rm,
        "--data.prompt_dataset": local.data,
        "--data.dataset": local.data,
        "--eval.dataset": local.eval_data,
        "--reward.remote_url": str(PARITY_FILE),
        "--train.agent_func_path": str(AGENT_EXAMPLE),
        "--ckpt.output_dir": str(local.run / "model"),  # what launch.local gives the learner as --save_path
        "--logger.tensorboard_dir": str(local.run / "tensorboard"),  # launch.local's --use_tensorboard
        "--ckpt.path": str(local.run.parent / "ckpt"),
        "--vllm.num_engines": str(FLEET_SERVERS),
        "--port": str(local.port),
    }
    if flag in fixed:
        return [fixed[flag]]
    if flag in SIZES:
        return [str(SIZES[flag](values[0], argv))]
    return ["1"]  # the other GPU counts: one node, one device, no tensor parallelism


def rewrite(argv: list[str], local: Local, *, cuda: bool = False) -> tuple[list[str], list[str]]:
    """The example's argv with only its models, data, output paths, sizes and GPU counts made
    local, and its GPU-only switches dropped on CPU. Returns (argv, one line per change)."""
    said: list[str] = []
    out: list[str] = []
    for flag, *values in groups(argv):
        what = kind(flag, values)
        new = local_values(flag, values, argv, local) if what else values
        if new != values:
            said.append(f"{what}: {flag} {shlex.join(values)} -> {shlex.join(new)}")
        out += [flag, *new]
    out, dropped = drop_gpu_only(out, cuda=cuda)
    return out, said + [f"dropped, GPU only: {d}" for d in dropped]


def test_rewrite_changes_only_those_tokens():
    """Every flag of every example is kept, in its order, with its values, unless it is of a
    rewritten kind (then only its values change) or a GPU-only switch (dropped on CPU)."""
    local = Local(policy="P", rm="RM", data="D", eval_data="E", run=Path("/r/run"), port=1)
    for script, example in EXAMPLES.items():
        before = groups(example["argv"])
        after = groups(rewrite(example["argv"], local)[0])
        gpu_only = [g for g in before if g[0] in GPU_ONLY and g[1:] == [GPU_ONLY[g[0]][0]]]
        kept = [g for g in before if g not in gpu_only]
        assert [g[0] for g in after] == [g[0] for g in kept], script
        for old, new in zip(kept, after, strict=True):
            assert old == new or (kind(old[0], old[1:]) and len(old) == len(new)), (script, old, new)
        on_gpu = groups(rewrite(example["argv"], local, cuda=True)[0])
        assert [g[0] for g in on_gpu] == [g[0] for g in before], script  # a GPU host keeps them


def report(script: str, changes: list[str], argv: list[str]) -> None:
    print(f"\n{script}: {len(changes)} rewrites")
    for c in changes:
        print("   ", c)
    print("   argv:", shlex.join(argv))


SAID = ("cannot act", "accepted, but", "needs CUDA", "inert")


def report_said(log: str) -> None:
    """What the run said at start-up about flags that cannot act here (Ray's placement flags counted)."""
    lines = [line for line in log.splitlines() if any(s in line for s in SAID) and '{"' not in line]  # not the config
    ray = [line for line in lines if "Ray placement" in line]
    for line in dict.fromkeys(line.split("WARNING ")[-1] for line in lines if line not in ray):
        print("   said:", line[:220])
    if ray:
        print(f"   said: {len(ray)} Ray placement flags accepted, placing nothing")


# ------------------------------------------------------------------------------ local data


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _value(argv: list[str], flag: str, default: str = "") -> str:
    g = [g for g in groups(argv) if g[0] == flag]
    return g[-1][1] if g and len(g[-1]) > 1 else default


def write_prompts(path: Path, argv: list[str], n: int) -> str:
    """Prompts under the example's --data.input_key (chat messages with --data.apply_chat_template,
    as OpenRLHF's prompt sets hold them) and its --data.label_key when it has one."""
    key, label = _value(argv, "--data.input_key", "input"), _value(argv, "--data.label_key")
    chat = "--data.apply_chat_template" in argv
    rows = []
    for i in range(n):
        a, b = i % 8, i // 8
        row = {key: _chat(f"{a}+{b}=") if chat else f"{a}+{b}="}
        if label:
            row[label] = str(a + b)
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_supervised(path: Path, argv: list[str], n: int = 8) -> str:
    """SFT rows under --data.input_key / output_key; preference rows under chosen_key /
    rejected_key (whole chats with --data.apply_chat_template, as OpenRLHF's preference sets)."""
    chat = "--data.apply_chat_template" in argv
    rows = []
    for i in range(n):
        q, good, bad = f"{i}+{i}=", str(2 * i), "no idea"
        if "--data.chosen_key" in argv or "--data.rejected_key" in argv:
            ck, rk = _value(argv, "--data.chosen_key", "chosen"), _value(argv, "--data.rejected_key", "rejected")
            if chat:
                rows.append(
                    {
                        ck: [*_chat(q), {"role": "assistant", "content": good}],
                        rk: [*_chat(q), {"role": "assistant", "content": bad}],
                    }
                )
            else:
                rows.append({ck: q + good, rk: q + bad})
        else:
            rows.append(
                {_value(argv, "--data.input_key", "input"): q, _value(argv, "--data.output_key", "output"): good}
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny_rm(tiny_model_dir, tmp_path_factory) -> str:
    """A reward model made from the tiny model (fresh head), with its tokenizer and the mean/std
    train_rm saves (read by --reward.normalize_enable)."""
    from transformers import AutoTokenizer

    from helpers.reward_models import build_tiny_rm

    out = build_tiny_rm(tiny_model_dir, tmp_path_factory.mktemp("examples_rm") / "rm")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(mean=0.0, std=1.0)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


# ------------------------------------------------------------------------------ PPO on the fleet


@pytest.fixture(scope="module")
def fleet_reward(_fleet):
    """Swaps the shared fleet's reward service for a run's (``SharedFleet.use_reward``); the
    fleet's own is back when the module is done."""
    yield _fleet.use_reward
    _fleet.use_reward(PARITY_REWARD)


@pytest.mark.parametrize("script", PPO)
def test_ppo_example_runs_on_the_shared_fleet(script, tmp_path, tiny_model_dir, tiny_rm, shared_fleet, fleet_reward):
    from common.config import parse
    from launch.local import _reward_flags_from_learner
    from learner.rl.config import PPOConfig

    example = EXAMPLES[script]["argv"]
    run = tmp_path / "run"
    local = Local(policy=str(tiny_model_dir), rm=tiny_rm, run=run)
    local.data = write_prompts(tmp_path / "prompts.jsonl", example, 64)
    local.eval_data = write_prompts(tmp_path / "eval.jsonl", example, 4)
    argv, changes = rewrite(example, local)
    added = ["--train.max_steps", str(STEPS)]
    if "--rollout.max_new_tokens" not in argv:  # the default, 1024 tokens, of a tiny model's noise: minutes on CPU
        added += ["--rollout.max_new_tokens", str(SIZES["--rollout.max_new_tokens"]("", argv))]
    argv += added
    report(script, [*changes, f"added: {shlex.join(added)}"], argv)
    # The reward service launch.local would start for these flags (a function or an RM, and the
    # reference for KL) stands in for the fleet's for this run; the rollout servers are the fleet's.
    cfg = parse(PPOConfig, ["--pretrain", str(tiny_model_dir), *argv], raise_errors=True)
    reward = shlex.join(_reward_flags_from_learner(cfg))
    print("   reward service:", reward)
    fleet_reward(reward)
    env = dict(cpu_env(), **offline_env(tmp_path / "wandb"), WANDB_DIR=str(tmp_path / "wandb"))
    t0 = time.monotonic()
    proc = start(local_cmd(run, tiny_model_dir, argv, reward=reward, fleet=shared_fleet), env)
    out = finish(proc, 600)
    log = (run / "logs" / "learner.log").read_text() if (run / "logs" / "learner.log").exists() else ""
    assert proc.returncode == 0, out[-3000:] + log[-5000:]
    steps = [m for m in metrics(run) if "rollout/reward" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1)), steps
    print(f"   {script}: {STEPS} steps in {time.monotonic() - t0:.0f} s")
    report_said(log)
    if cfg.needs_critic:
        assert all("critic/value_loss" in m for m in steps), steps[-1].keys()
    if cfg.train.colocate_all:
        assert "schedule: colocated" in log
    if cfg.train.agent_func_path:  # episodes of the agent file, scored by it; the reference from the service
        assert all(m["agent/turns"] >= 1 for m in steps), steps[-1]
    assert (run / "model" / "config.json").exists()


# ------------------------------------------------------------------------------ the others


def _module_cmd(command: str, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", MODULES[command], *argv]


def test_async_agent_example_is_refused_at_start_up(tmp_path):
    """OpenRLHF's async agent example time-shares the GPUs (colocated) while generating async;
    rayless's async schedule generates while the learner trains, so the learner refuses the pair
    when its flags parse, before it loads anything, and says how to choose."""
    script = "train_reinforce_baseline_ray_agent_async"
    example = EXAMPLES[script]
    local = Local(policy="unused", run=tmp_path / "run")
    local.data = write_prompts(tmp_path / "prompts.jsonl", example["argv"], 8)
    argv, changes = rewrite(example["argv"], local)
    report(script, changes, argv)
    proc = subprocess.run(
        _module_cmd(example["command"], argv),
        cwd=tmp_path,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and REFUSED[script] in proc.stderr, proc.stderr[-2000:]
    print("   refused:", [line for line in proc.stderr.splitlines() if REFUSED[script] in line][0][:200])


@pytest.mark.parametrize("script", SUPERVISED)
def test_supervised_example_runs(script, tmp_path, tiny_model_dir):
    """Two optimizer steps (8 rows, batches of 4), in the test's folder: the example's relative
    output and checkpoint paths (``./checkpoint/...``) land there as they would in its own."""
    example = EXAMPLES[script]
    local = Local(policy=str(tiny_model_dir), run=tmp_path / "run")
    local.data = write_supervised(tmp_path / "data.jsonl", example["argv"])
    argv, changes = rewrite(example["argv"], local)
    report(script, changes, argv)
    t0 = time.monotonic()
    proc = subprocess.run(
        _module_cmd(example["command"], argv),
        cwd=tmp_path,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    print(f"   {script}: {time.monotonic() - t0:.0f} s")
    report_said(out)
    save = tmp_path / _value(argv, "--ckpt.output_dir")
    assert (save / "config.json").exists(), sorted(p.name for p in tmp_path.rglob("*"))[:50]
    logged = [json.loads(line) for line in (save / "train_log.jsonl").read_text().splitlines()]
    assert max(r.get("step", r.get("global_step", 0)) for r in logged) == STEPS, logged[-3:]


def test_serve_rm_example_serves_a_reward(tmp_path, tiny_rm):
    """serve_rm's example started with its argv rewritten, and one OpenRLHF request scored."""
    from common.net import free_port

    script = "serve_remote_rm"
    example = EXAMPLES[script]
    local = Local(policy="unused", rm=tiny_rm, run=tmp_path / "run", port=free_port())
    argv, changes = rewrite(example["argv"], local)
    report(script, changes, argv)
    log_path = tmp_path / "serve_rm.log"
    with open(log_path, "w") as f:
        proc = subprocess.Popen(
            _module_cmd(example["command"], argv), cwd=tmp_path, env=worker_env(), stdout=f, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{local.port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"serve_rm exited {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.2)
        body = json.dumps({"query": ["3+4=7", "3+4=banana"], "prompts": ["3+4="] * 2, "labels": [None] * 2})
        req = urllib.request.Request(
            f"{url}/get_reward", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert len(answer["rewards"]) == 2 and all(x == x for x in answer["rewards"]), answer
        print("   scored:", answer["rewards"])
        report_said(log_path.read_text())
    finally:
        proc.terminate()
        proc.wait(30)
