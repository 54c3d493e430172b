"""Rollout service overheads, measured against the bare parts in the same run.

1. Generation: tokens/s of prompts sent through a rollout server (controller -> ZMQ ->
   ``RolloutCore`` -> vLLM ``AsyncLLM`` -> ZMQ -> controller, timed at the controller) vs bare
   ``vllm.LLM.generate`` in this process, on the same prompts, sampling parameters and engine
   settings. The service gets the prompts as one PromptBatch, as from the learner; seed S + n * prompt
   id per prompt (the protocol's rule, n = 1 here) on both paths makes both sample the same tokens. The two
   run in alternating
   rounds, so load from elsewhere on the machine hits both alike; the median of the per-round
   ratios is the number to read. Goal: >= 0.95. Between the two, the bench waits ``--gap_s``:
   a vLLM engine that just finished keeps spinning (``sched_yield``) on its shared-memory
   queues for 1 s (``SpinCondition.busy_loop_s``), which on 2 cores takes a core from whichever
   path runs next.
2. Weight update: one full push (start / update / finish: pause, gloo transfer in buckets,
   load into vLLM, prefix-cache reset, resume) vs one raw gloo broadcast of the same number of
   bytes to a bare receiver process. On the tiny model (2.4 MB) fixed costs dominate; the
   ``--sync_mb`` model (a random Qwen2 of about that size, built here) shows the transfer-bound
   case. Pushes and raw broadcasts alternate; the median of the paired ratios is the number to
   read. Goal: <= 1.3. The raw broadcast is timed into a new buffer and into a kept one; and
   vLLM's own reload of the same weights from memory (no transfer, a bare engine) is timed, as
   the part of a push no transfer code can remove: on CPU, where transfer and load both need
   the cores, push / (raw + load) is what the push path itself adds.

Run: ``python bench/rollout.py [--rounds 8] [--prompts 64] [--max_new_tokens 256] [--sync_mb 400]``
(needs vllm; prints a JSON summary line last).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from _setup import prepare

REPO = prepare(tests=True)

# What the rollout server passes to vLLM on CPU (rollout_service/core.py), for the bare engine.
ENGINE = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=64,
    seed=0,
    enable_prefix_caching=True,
    logprobs_mode="processed_logprobs",
    gpu_memory_utilization=0.05,
    enable_chunked_prefill=False,
)


def build_model(out: Path, tiny: Path, target_mb: float) -> Path:
    """A random Qwen2 of about ``target_mb`` MB (fp32) sharing the tiny model's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = json.loads((tiny / "config.json").read_text())
    hidden = 1024
    per_layer = 4 * hidden * hidden + 3 * hidden * 3 * hidden  # q,k,v,o (no GQA saving) + MLP, roughly
    layers = max(1, round(target_mb * 1e6 / 4 / per_layer))
    config = Qwen2Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        dtype="float32",
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def _raw_receiver(port: int, nbytes: int, rounds: int) -> None:
    import torch

    from common.weights.gloo import GlooGroup

    group = GlooGroup.open("127.0.0.1", port, 1, 2, timeout_s=120, label="bench")
    kept = torch.empty(nbytes, dtype=torch.uint8)
    group.broadcast(kept).wait()  # warm-up, and first touch of the kept buffer
    for _ in range(rounds):
        group.broadcast(torch.empty(nbytes, dtype=torch.uint8)).wait()  # into a new buffer
        group.broadcast(kept).wait()  # into a buffer already in memory


class RawPeer:
    """A bare receiver process in its own gloo group: the floor a weight push is measured against.
    Each round it receives the bytes twice, into a new buffer (first touch: page faults) and into
    one kept from before; it does nothing with them."""

    def __init__(self, nbytes: int, rounds: int) -> None:
        import torch

        from common.weights.gloo import GlooGroup

        store = GlooGroup.host_store("127.0.0.1", 2, 120)
        self.proc = mp.get_context("spawn").Process(target=_raw_receiver, args=(store.port, nbytes, rounds))
        self.proc.start()
        self.group = GlooGroup.open("127.0.0.1", store.port, 0, 2, timeout_s=120, label="bench", store=store)
        self.data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.group.broadcast(self.data).wait()  # warm-up: connections, first touch

    def time_one(self) -> tuple[float, float]:
        """Seconds of one broadcast into a new buffer, and of one into a kept buffer."""
        out = []
        for _ in range(2):
            t0 = time.perf_counter()
            self.group.broadcast(self.data).wait()
            out.append(time.perf_counter() - t0)
        return out[0], out[1]

    def close(self) -> None:
        self.proc.join(60)


def sync_bench(ctrl, rounds: int, gap_s: float) -> dict:
    """Full pushes and raw broadcasts of the same byte count, alternating (medians reported)."""
    nbytes = ctrl.publisher.source.nbytes()
    raw = RawPeer(nbytes, rounds)
    ctrl.fleet.push(1)  # warm-up
    pushes, raws, kept, phases = [], [], [], []
    for r in range(rounds):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        report = ctrl.fleet.push(r + 2)
        pushes.append(time.perf_counter() - t0)
        phases.append(report.seconds)
        time.sleep(gap_s)
        fresh, warm = raw.time_one()
        raws.append(fresh)
        kept.append(warm)
    raw.close()
    med = statistics.median
    return {
        "mb": round(nbytes / 1e6, 2),
        "push_s": round(med(pushes), 4),
        "raw_s": round(med(raws), 4),
        "raw_kept_buffer_s": round(med(kept), 4),
        "ratio_of_medians": round(med(pushes) / med(raws), 2),
        # Each push is paired with the raw broadcast right after it: the median of the paired
        # ratios is the robust number on a machine whose load drifts.
        "paired_ratio_median": round(med(p / r for p, r in zip(pushes, raws, strict=True)), 2),
        "ratios": [round(p / r, 2) for p, r in zip(pushes, raws, strict=True)],
        "paired_ratio_vs_kept_buffer": round(med(p / r for p, r in zip(pushes, kept, strict=True)), 2),
        "push_phases_median_s": {k: round(med(ph[k] for ph in phases), 4) for k in phases[0]},
    }


def _reload_from_memory(worker, model_dir: str, rounds: int) -> dict:
    """Runs inside a bare vLLM worker (``collective_rpc``): vLLM's own reload of the model's
    weights from tensors already in memory -- the load path a push ends in, without the transfer
    -- timed against one plain copy of the same bytes."""
    import glob
    import statistics
    import time

    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    state = {}
    for f in sorted(glob.glob(f"{model_dir}/*.safetensors")):
        state.update(load_file(f))
    model = worker.get_model()
    loads, copies = [], []
    for _ in range(rounds):
        # Fresh tensors each round, as a push delivers them (received into new buffers).
        fresh = [(n, t.clone()) for n, t in state.items()]
        t0 = time.perf_counter()
        initialize_layerwise_reload(model)
        model.load_weights(fresh)
        finalize_layerwise_reload(model, worker.model_config)
        loads.append(time.perf_counter() - t0)
        dst = [torch.empty_like(t) for _, t in fresh]
        t0 = time.perf_counter()
        for d, (_, t) in zip(dst, fresh, strict=True):
            d.copy_(t)
        copies.append(time.perf_counter() - t0)
    return {"load_s": statistics.median(loads), "copy_s": statistics.median(copies)}


def load_only_bench(model_dir: Path, rounds: int) -> dict:
    """vLLM's in-memory reload of ``model_dir`` in a bare engine (no rollout service, no transfer)."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function: bench only
    from vllm import LLM

    llm = LLM(model=str(model_dir), **{**ENGINE, "max_model_len": 256, "max_num_seqs": 4})
    try:
        out = llm.collective_rpc(_reload_from_memory, args=(str(model_dir), rounds))[0]
    finally:
        del llm
    return {k: round(v, 4) for k, v in out.items()}


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds used so far by this process and everything under it, by process name
    (vLLM names its processes: VLLM::EngineCore, VLLM::Worker...; the rollout server is
    ``python -m rollout_service``)."""
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {}
    server_pids = {c.pid for c in me.children() if "rollout_service" in " ".join(c.cmdline())}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            chain = {p.pid, *(a.pid for a in p.parents())}
            side = "server" if chain & server_pids else "bench"
            key = f"{side}:{p.name()}"
            out[key] = out.get(key, 0.0) + t.user + t.system
        except psutil.Error:
            continue  # exited in between
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 2) for k in after if after[k] - before.get(k, 0.0) >= 0.01}


def make_prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(16, 48))] for _ in range(n)]


def service_tokens_per_s(ctrl, prompts, max_new: int, first_id: int) -> tuple[float, int]:
    from common import protocol as P

    ids = list(range(first_id, first_id + len(prompts)))
    ctrl.results.clear()
    t0 = time.perf_counter()
    # One PromptBatch, as the learner sends them; prompt P is sampled with seed 0 + n * P (n = 1).
    sampling = P.SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0)
    assert not ctrl.client.submit(ids, prompts, sampling)
    ctrl.wait_results(ids, timeout=1800)
    dt = time.perf_counter() - t0
    tokens = sum(
        sum(b.response_lengths[i] for i, p in enumerate(b.prompt_ids) if p == pid)
        for pid, b in ((pid, ctrl.results[pid]) for pid in ids)
    )
    return tokens / dt, tokens


def bare_tokens_per_s(llm, prompts, max_new: int, first_id: int) -> tuple[float, int]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=max_new,
            seed=first_id + i,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        for i in range(len(prompts))
    ]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / dt, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="alternating service/bare rounds (median reported)")
    ap.add_argument("--prompts", type=int, default=64)
    # Rounds of a few seconds: at 128 tokens a round is ~1 s and scheduler noise swamps the ratio.
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--sync_rounds", type=int, default=7)
    ap.add_argument(
        "--gap_s",
        type=float,
        default=2.0,
        help="idle time before each timed part: lets the other engine's 1 s busy-poll end",
    )
    ap.add_argument("--skip_generation", action="store_true", help="only the weight-sync part (big model)")
    ap.add_argument("--sync_mb", type=float, default=400, help="size of the weight-sync model (0: skip)")
    ap.add_argument("--out", default="", help="also write the JSON summary here")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from common.tiny import build_tiny_model
    from helpers.rollout_harness import Controller

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    tiny = build_tiny_model(work / "tiny")
    summary: dict = {"host_cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()[0]}
    serve_args = ("--max_model_len", str(ENGINE["max_model_len"]), "--max_num_seqs", str(ENGINE["max_num_seqs"]))

    # ---------------------------------------------------------------- generation
    if not args.skip_generation:
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
        ctrl = Controller(model, peer_timeout_s=120, weight_timeout_s=120)
        try:
            ctrl.start("bench-r0", work, *serve_args)
            llm = LLM(model=str(tiny), **ENGINE)
            ctrl.wait_joined(["bench-r0"], timeout=900)
            vocab = model.config.vocab_size
            warm = make_prompts(8, 999, vocab)
            service_tokens_per_s(ctrl, warm, 16, 10_000_000)
            bare_tokens_per_s(llm, warm, 16, 10_000_000)
            svc, bare = [], []
            cpu: dict[str, list] = {"service": [], "bare": []}  # CPU seconds by process, per round
            paths = {"service": partial(service_tokens_per_s, ctrl), "bare": partial(bare_tokens_per_s, llm)}

            def timed(path: str, prompts, first: int):
                time.sleep(args.gap_s)
                before = cpu_snapshot()
                out = paths[path](prompts, args.max_new_tokens, first)
                cpu[path].append(cpu_used(before, cpu_snapshot()))
                return out

            for r in range(args.rounds):
                prompts = make_prompts(args.prompts, r, vocab)
                first = (r + 1) * 100_000
                # Which goes first alternates, so neither always follows the other's idle engine.
                order = ("service", "bare") if r % 2 == 0 else ("bare", "service")
                got = {path: timed(path, prompts, first) for path in order}
                (s_rate, s_tok), (b_rate, b_tok) = got["service"], got["bare"]
                svc.append(s_rate)
                bare.append(b_rate)
                print(
                    f"round {r}: service {s_rate:.0f} tok/s ({s_tok} tokens), bare vLLM {b_rate:.0f} tok/s "
                    f"({b_tok} tokens), ratio {s_rate / b_rate:.3f}\n  CPU s, service: {cpu['service'][-1]}"
                    f"\n  CPU s, bare: {cpu['bare'][-1]}",
                    flush=True,
                )
            summary["generation"] = {
                "prompts": args.prompts,
                "max_new_tokens": args.max_new_tokens,
                "rounds": args.rounds,
                "service_tok_s": round(statistics.median(svc), 1),
                "bare_tok_s": round(statistics.median(bare), 1),
                "ratio_of_medians": round(statistics.median(svc) / statistics.median(bare), 3),
                "paired_ratio_median": round(statistics.median(s / b for s, b in zip(svc, bare, strict=True)), 3),
                "ratios": [round(s / b, 3) for s, b in zip(svc, bare, strict=True)],
            }
            del llm

            summary["weight_sync_tiny"] = sync_bench(ctrl, args.sync_rounds, args.gap_s)
            print("weight sync (tiny):", summary["weight_sync_tiny"], flush=True)
        finally:
            ctrl.close()

    # ---------------------------------------------------------------- weight sync, transfer-bound
    if args.sync_mb > 0:
        big_dir = build_model(work / "sync-model", tiny, args.sync_mb)
        big = AutoModelForCausalLM.from_pretrained(big_dir, dtype=torch.float32).eval()
        ctrl = Controller(big, peer_timeout_s=300, weight_timeout_s=300, bucket_bytes=64 << 20)
        try:
            ctrl.start("bench-sync", work, "--max_model_len", "256", "--max_num_seqs", "4")
            ctrl.wait_joined(["bench-sync"], timeout=900)
            summary["weight_sync_big"] = sync_bench(ctrl, args.sync_rounds, args.gap_s)
            print("weight sync (big):", summary["weight_sync_big"], flush=True)
        finally:
            ctrl.close()
        # What loading alone costs in vLLM on this platform. Where the transfer keeps every core
        # busy (2 cores: sender and receiver), loading cannot overlap it, and raw + load is the
        # floor a push can reach; push / (raw + load) is then what the push path itself adds.
        sync = summary["weight_sync_big"]
        sync["load_only"] = load_only_bench(big_dir, max(3, args.sync_rounds // 2))
        load = sync["load_only"]["load_s"]
        sync["push_over_raw_plus_load"] = round(sync["push_s"] / (sync["raw_s"] + load), 2)
        sync["push_over_raw_kept_plus_load"] = round(sync["push_s"] / (sync["raw_kept_buffer_s"] + load), 2)
        print(
            "vLLM reload from memory (big):",
            sync["load_only"],
            "push / (raw + load):",
            sync["push_over_raw_plus_load"],
            "with a kept raw buffer:",
            sync["push_over_raw_kept_plus_load"],
            flush=True,
        )
    shutil.rmtree(work, ignore_errors=True)
    line = json.dumps(summary)
    print("SUMMARY " + line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":  # vLLM and the receiver spawn processes that re-import __main__
    main()
