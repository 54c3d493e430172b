"""Greedy-generate with vllm.LLM on a model dir; print one JSON line of token ids.

Run as a script (vLLM may spawn worker processes, which re-import __main__):
    python tests/helpers/vllm_greedy.py MODEL_DIR --prompt-ids '[[1, 2, 3], ...]' --max-tokens 16
Output: a line `RESULT {"token_ids": [[...], ...], "dtype": "..."}`.
"""

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt-ids", required=True, help="JSON list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(args.prompt_ids)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "dtype": str(llm.llm_engine.model_config.dtype),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
