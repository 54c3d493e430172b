"""What a checkpoint's manifest costs on a SmolLM2-135M-sized checkpoint: the checksums against
DeepSpeed's own save of the same files, in the same run.

    python bench/checkpoint_manifest.py [--bf16] [--dir DIR]

Builds SmolLM2-135M-Instruct's architecture (LlamaForCausalLM, 30 layers, hidden 576, vocab
49152, tied embeddings; random weights: the bytes, not the values, cost) as a one-rank
DeepSpeed engine with AdamW, takes one optimizer step so the optimizer state exists, then:

1. the engine's own ``save_checkpoint`` (what every checkpoint pays anyway), into the page
   cache, and the same followed by ``sync`` (the bytes on disk);
2. listing the files' sizes, and hashing them (CRC32, SHA-256) straight after the save (the
   page cache holds them, as it does when ``Checkpointer.save`` hashes);
3. ``Checkpointer.save`` end to end with and without checksums (it fsyncs state.json and the
   manifest, which on ext4 writes the checkpoint's data out first: its figure is a durable
   save's, like "save + sync"), and ``verify``, what a resume checks first.

Each timing starts after a ``sync``; prints the median of ``--repeats`` and its ratio to the
DeepSpeed save. Why CRC32 was chosen:
``learner/runtime/checkpoint_manifest.py``; the figures: docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import _setup

_setup.prepare()

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bf16", action="store_true", help="bf16 weights (fp32 master and Adam state)")
    p.add_argument("--repeats", type=int, default=3, help="timings per figure (the median is printed)")
    p.add_argument("--dir", default="", help="where to write the checkpoints (default: a temporary folder)")
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.runtime import checkpoint as R
    from learner.runtime import checkpoint_manifest as M
    from learner.runtime import engine as E

    E.init_distributed()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    n_params = sum(p.numel() for p in model.parameters())
    engine = E.make_engine(
        model,
        zero_stage=2,
        bf16=args.bf16,
        train_batch_size=1,
        micro_train_batch_size=1,
        learning_rate=1e-5,
        num_training_steps=10,
    )
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (1, 16))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    runs: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        runs.setdefault(name, []).append(seconds)

    def manager_save(checksums: bool) -> None:
        out = root / "managed"
        ckpt = R.Checkpointer(out, checksums=checksums)
        ckpt.add_engine("policy", engine)
        os.sync()  # each save starts with nothing of the last one left to write back
        record(f"Checkpointer.save, {'sizes + crc32' if checksums else 'sizes only'}", timed(lambda: ckpt.save(1))[0])
        if checksums:
            record("verify (resume's check, crc32)", timed(lambda: R.verify(R.step_dir(out, 1)))[0])
        shutil.rmtree(out)

    ds_dir = root / "plain"
    try:
        for i in range(args.repeats):
            os.sync()
            record(
                "DeepSpeed save_checkpoint (baseline)", timed(lambda: engine.save_checkpoint(str(ds_dir), tag="ds"))[0]
            )
            t, sizes = timed(lambda: M.file_sizes(ds_dir))
            record("list sizes", t)
            # The closures run at once; binding this round's ``sizes`` says so.
            record("crc32 of every file", timed(lambda sizes=sizes: M.checksums(ds_dir, sizes))[0])
            record("sha256 of every file", timed(lambda sizes=sizes: {n: sha256(ds_dir / n) for n in sizes})[0])
            os.sync()
            record(
                "DeepSpeed save_checkpoint + sync",
                timed(lambda: (engine.save_checkpoint(str(ds_dir), tag="ds"), os.sync()))[0],
            )
            shutil.rmtree(ds_dir)
            for checksums in (i % 2 == 0, i % 2 == 1):  # alternate which goes first
                manager_save(checksums)

        total = sum(sizes.values())
        gb = total / 1e9
        print(
            f"SmolLM2-135M-shaped model: {n_params / 1e6:.1f} M parameters, {'bf16' if args.bf16 else 'fp32'}; "
            f"checkpoint {gb:.2f} GB in {len(sizes)} files ({os.cpu_count()} CPUs); median of {args.repeats}"
        )
        base = statistics.median(runs["DeepSpeed save_checkpoint (baseline)"])
        for name, times in runs.items():
            t = statistics.median(times)
            print(f"  {name:38s} {t:7.2f} s  {t / base:5.2f}x the save  ({gb / max(t, 1e-9):7.2f} GB/s)")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
