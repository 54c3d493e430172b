"""What a teacher costs the reward service, against the reference model it generalises.

On-policy distillation (docs/distillation.md) serves the teacher with the reference model's code
(``reward_service.scorer.load_logprob_model``), so a teacher of the reference's size should cost
what the reference costs (goal of issue 43: within 1.1x). Three in-process ``Scorer``s on the same
checkpoint (the tiny model, HF backend, fp32, one torch thread) score the same requests:

* ``ref``: ``--ref_pretrain M`` (what a KL run's services do);
* ``teacher``: ``--teacher_pretrain M --tokenizer M`` (pure distillation);
* ``both``: both (a distillation run with KL): the second model's cost on top.

Each request is ``--samples`` samples with prompts of ``--prompt_len`` and responses of
``--response_len`` random tokens. The three are run in turn, ``--iters`` rounds after one warm-up
round; the figure is the median CPU seconds of ``Scorer.score`` (``time.process_time``: the work
done, which a shared host does not inflate as it does wall time) and each one's ratio to ``ref``.

Run::

    python bench/distill_cost.py                       # 64 samples, 32 + 128 tokens, 7 rounds
    python bench/distill_cost.py --response_len 512 --iters 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _setup

_setup.prepare()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--response_len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()

    import torch

    from common.protocol import SampleBatch, ScoreRequest
    from common.tiny import build_tiny_model
    from reward_service.config import parse_config
    from reward_service.scorer import Scorer

    torch.set_num_threads(1)
    model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    g = torch.Generator().manual_seed(0)
    n, p, r = args.samples, args.prompt_len, args.response_len
    request = ScoreRequest(
        samples=SampleBatch(
            prompt_ids=list(range(n)),
            sample_indices=[0] * n,
            response_lengths=[r] * n,
            response_ids=torch.randint(3, 700, (n * r,), generator=g).int(),
            prompt_token_ids=torch.randint(3, 700, (n, p), generator=g).tolist(),
        )
    )
    flags = {
        "ref": ["--ref_pretrain", model],
        "teacher": ["--teacher_pretrain", model, "--tokenizer", model],
        "both": ["--ref_pretrain", model, "--teacher_pretrain", model],
    }
    scorers = {k: Scorer.from_config(parse_config(["--controller", "-", *v])) for k, v in flags.items()}
    times: dict[str, list[float]] = {k: [] for k in scorers}
    for i in range(args.iters + 1):
        for name, scorer in scorers.items():
            t0 = time.process_time()
            out = scorer.score(request)
            if i:  # the first round warms up
                times[name].append(time.process_time() - t0)
            assert (out.ref_logprobs is not None) == (name != "teacher")
            assert (out.teacher_logprobs is not None) == (name != "ref")
    for s in scorers.values():
        s.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "request": f"{n} samples x ({p} prompt + {r} response) tokens",
        "cpu_s_median": {k: round(v, 4) for k, v in med.items()},
        "ratio_to_ref": {k: round(v / med["ref"], 3) for k, v in med.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
