"""LoRA weight push: the adapter alone (``--lora_sync adapter``) against the merged weights.

Starts one real rollout server (``python -m rollout_service --enable_lora``, vLLM on CPU, the
harness of ``tests/helpers/rollout_harness.py``) on the tiny model or ``--model DIR`` (SmolLM2:
``python -m common.smollm2 DIR``), wraps the same model with rank-``--rank`` adapters on every
linear layer (B nonzero), and pushes it to the server round after round through each mode:

- ``merged``: ``W + alpha/r B A`` per adapted weight, computed in fp32 as it is sent, every
  weight on the wire and loaded by vLLM (its layerwise reload, the prefix-cache reset);
- ``adapter``: the adapter's tensors alone, written by the server's worker as a PEFT folder and
  loaded with ``add_lora`` (``WeightUpdateStart.adapter_only``: generation is not paused).

Each mode has its own publisher (the learner's setting); the server's weight group goes to the
publisher of the mode being measured before its untimed push (the adapter's first push also
brings the base weights), and the timed push follows it. Modes alternate within each round (the
box's speed drifts); each figure is the median over the rounds. Per push, from
``PushReport.seconds``: ``push`` = start + transfer + finish (everything the server does too),
and the bytes on the wire.

The figure to read is adapter / merged push seconds (goal <= 0.2 on SmolLM2-135M, rank 16).

Run: ``flock /tmp/rayless-slow.lock python bench/lora_push.py [--model DIR] [--rounds 5]``
(a table, then a JSON summary line).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from _setup import prepare

REPO = prepare(tests=True)

MODES = ("merged", "adapter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="HF model folder (default: the tiny model, built here)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="", help="also write the summary here")
    args = ap.parse_args()

    from common.tiny import build_tiny_model
    from common.weights.publisher import WeightPublisher
    from helpers.lora_models import lora_model
    from helpers.rollout_harness import Controller

    work = Path(tempfile.mkdtemp(prefix="rayless-lora-push-"))
    model_dir = args.model or str(build_tiny_model(work / "tiny"))
    model = lora_model(model_dir, args.rank, alpha=2 * args.rank, b_scale=0.01)
    ctrl = Controller(model.get_base_model(), weight_timeout_s=300.0)
    ctrl.model.name_or_path = model_dir
    try:
        ctrl.start("r0", work, "--enable_lora", "--max_lora_rank", str(args.rank), "--max_num_seqs", "8")
        ctrl.wait_joined(["r0"], timeout=900)
        caps = ctrl.client.peer("r0").capabilities
        pubs = {
            mode: WeightPublisher(model, control=ctrl.client, backend="gloo", timeout_s=300.0, lora_sync=mode)
            for mode in MODES
        }
        times: dict[str, list[float]] = {m: [] for m in MODES}
        nbytes: dict[str, int] = {}
        version = 1
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                pub = pubs[mode]
                pub.connect("r0", workers=caps.workers, dtype=caps.dtype)  # the server's group: this publisher's
                pub.push(version)  # untimed: the adapter's first push brings the base weights too
                report = pub.push(version + 1)
                version += 2
                assert report.updated == ["r0"] and not report.failed, report
                s = report.seconds
                times[mode].append(s["start"] + s["transfer"] + s["finish"])
                nbytes[mode] = report.bytes_per_server
                print(f"round {r + 1} {mode:<8} push {times[mode][-1]:.3f} s, {nbytes[mode] / 1e6:.2f} MB", flush=True)
        med = {m: statistics.median(times[m]) for m in MODES}
        summary = {
            "model": args.model or "tiny",
            "rank": args.rank,
            "rounds": args.rounds,
            "push_s": {m: round(med[m], 4) for m in MODES},
            "mb": {m: round(nbytes[m] / 1e6, 3) for m in MODES},
            "adapter_over_merged": round(med["adapter"] / med["merged"], 3),
        }
        print(
            f"{'mode':<8} {'push s (median)':>16} {'MB':>8}\n"
            + "\n".join(f"{m:<8} {med[m]:>16.3f} {nbytes[m] / 1e6:>8.2f}" for m in MODES)
            + f"\nadapter / merged push: {summary['adapter_over_merged']:.3f} (goal <= 0.2 on SmolLM2)"
        )
        print(json.dumps(summary))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        for pub in pubs.values():
            pub.close()
    finally:
        ctrl.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
