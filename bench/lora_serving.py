"""What vLLM on this machine does with a LoRA adapter: the facts ``--lora_sync adapter`` would build on.

For a model (the tiny one, built locally, by default; ``--model DIR`` for another, e.g.
SmolLM2) and a peft adapter made here (rank 8, every linear layer but the head, B drawn
nonzero), one process per engine configuration, vLLM's offline ``LLM``:

- **agreement**: the log-prob of each greedy token vLLM samples with the adapter, against an
  fp32 ``PeftModel`` teacher-forced on the same tokens (max abs difference), and whether the
  adapter changed the greedy tokens at all (it must, or the check is empty);
- **add_lora**: ms to load the adapter from its folder, and to load a second one;
- **speed**: generated tokens/s with ``enable_lora`` off, on for base requests, and on for
  requests using the adapter (best of 3 on the same prompts; the ratios are what carries over).

    python bench/lora_serving.py                 # tiny model, ~2 min
    python bench/lora_serving.py --model DIR     # any local HF causal LM
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _setup

REPO = _setup.prepare()

PROMPTS = [f"What is {i} + {2 * i + 3}? Reverse the string hello{i}." for i in range(32)]
TOKENS = 64


def make_adapter(model: str, out: Path, seed: int, rank: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    m = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:  # peft starts B at zero: an adapter that changes nothing
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    m.save_pretrained(out)


def child(model: str, adapters: list[str], mode: str, rank: int) -> dict:
    """One engine: ``off`` (no LoRA) or ``on`` (LoRA enabled; agreement, add_lora and speed)."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = dict(enable_lora=True, max_lora_rank=rank, max_loras=2, max_cpu_loras=2) if mode == "on" else {}
    llm = LLM(
        model=model,
        dtype="float32",
        seed=0,
        max_model_len=512,
        max_num_seqs=16,
        enforce_eager=True,
        gpu_memory_utilization=0.08,
        enable_chunked_prefill=False,  # vLLM 0.32 on CPU (rollout_service/core.py)
        enable_prefix_caching=True,
        **lora,
    )
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    llm.generate(PROMPTS[:4], sp, use_tqdm=False)  # warm-up
    out: dict = {}
    cases: list[tuple[str, LoRARequest | None]] = [("base", None)]
    if mode == "on":
        reqs = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
        for i, r in enumerate(reqs):
            t = time.perf_counter()
            assert llm.llm_engine.add_lora(r)
            out[f"add_lora_ms_{i}"] = 1e3 * (time.perf_counter() - t)
        greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=0)
        base = llm.generate(PROMPTS[:3], greedy, use_tqdm=False)
        tuned = llm.generate(PROMPTS[:3], greedy, lora_request=reqs[0], use_tqdm=False)
        pairs = list(zip(base, tuned, strict=True))
        out["changed_prompts"] = sum(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in pairs)
        # How far the adapter moved the log-probs of the tokens both runs chose alike.
        out["shift"] = max(
            abs(la[t].logprob - lb[t].logprob)
            for a, b in pairs
            for la, lb, t, u in zip(
                a.outputs[0].logprobs,
                b.outputs[0].logprobs,
                a.outputs[0].token_ids,
                b.outputs[0].token_ids,
                strict=True,
            )
            if t == u
        )
        out["samples"] = [
            (
                list(o.prompt_token_ids),
                list(o.outputs[0].token_ids),
                [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)],
            )
            for o in tuned
        ]
        cases.append(("adapter", reqs[0]))
    for name, req in cases:
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            outs = llm.generate(PROMPTS, sp, lora_request=req, use_tqdm=False)
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        out[f"tok_s_{name}"] = best
    return out


def peft_logprobs(model: str, adapter: str, samples: list) -> float:
    """Max abs difference between vLLM's sampled-token log-probs and an fp32 PeftModel's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), adapter).eval()
    worst = 0.0
    for prompt, tokens, vllm_lps in samples:
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logp = torch.log_softmax(m(ids).logits[0].float(), -1)
        p = len(prompt)
        mine = logp[p - 1 : p - 1 + len(tokens)].gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst = max(worst, (mine - torch.tensor(vllm_lps)).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a local HF model folder (default: the tiny model, built here)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_adapters", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print("RESULT " + json.dumps(child(args.model, args._adapters, args._child, args.rank)), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="lora-serving-"))
    model = args.model
    if not model:
        from common.tiny import build_tiny_model

        model = str(build_tiny_model(work / "tiny"))
    adapters = [str(work / f"adapter{i}") for i in range(2)]
    for i, path in enumerate(adapters):
        make_adapter(model, Path(path), seed=i, rank=args.rank)
    res = {}
    for mode in ("off", "on"):
        cmd = [sys.executable, __file__, "--model", model, "--rank", str(args.rank), "--_child", mode]
        proc = subprocess.run([*cmd, "--_adapters", *adapters], capture_output=True, text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"engine with LoRA {mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        res[mode] = json.loads(lines[-1][len("RESULT ") :])
    on, off = res["on"], res["off"]
    diff = peft_logprobs(model, adapters[0], on["samples"])
    print(f"model {model}, adapter rank {args.rank} (alpha {2 * args.rank}, all linear layers, B nonzero)")
    print(
        f"agreement: max |vLLM - PeftModel fp32| sampled-token log-prob {diff:.2e}; the adapter changed {on['changed_prompts']} of 3 greedy answers, moved shared tokens' log-probs by up to {on['shift']:.2f}"
    )
    print(f"add_lora: {on['add_lora_ms_0']:.1f} ms, a second adapter {on['add_lora_ms_1']:.1f} ms")
    print(
        f"generated tokens/s (32 x {TOKENS}, best of 3): LoRA off {off['tok_s_base']:.0f}; on, base requests "
        f"{on['tok_s_base']:.0f} ({on['tok_s_base'] / off['tok_s_base']:.2f}x); on, adapter requests "
        f"{on['tok_s_adapter']:.0f} ({on['tok_s_adapter'] / off['tok_s_base']:.2f}x)"
    )


if __name__ == "__main__":
    main()
