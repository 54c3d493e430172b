"""Reference scorer on a vLLM engine: the reference model served across a node's GPUs.

``--ref_backend vllm``: per-token reference log-probs come from vLLM's *prompt* log-probs of
the sequence prompt + response (``SamplingParams(max_tokens=1, prompt_logprobs=0)``: for each
position, the log-prob of the token that is there), read at the response positions. This is
for reference models that do not fit on one GPU: vLLM shards them with
``--ref_tensor_parallel_size`` (a 70B bf16 reference needs 140 GB of weights alone), batches
and pages the KV cache itself, and uses the same kernels as the rollout servers. The HF backend
(``ref_model.py``) stays the default for models that fit one device.

Same contract as ``ReferenceScorer``: ``logprobs(prompts, responses) -> (L,)`` float32, the
responses' log-probs concatenated in input order. vLLM's log-probs are taken from the raw logits
(its default ``logprobs_mode``), so the temperature must be 1: the config refuses anything else.
On the tiny model in fp32 they equal transformers' to ~1e-6 (``tests/unit/reward_service/
test_ref_vllm.py``).

Memory: ``--ref_gpu_memory_utilization``, else 0.9 on GPUs and on CPU what the engine needs of
its NUMA node, checked against vLLM-CPU's start-up rule before the engine starts, as the rollout
server does (``common/vllm_memory.py``): a refusal is one line naming the flag.

Exit: ``close`` stops the engine and waits for the client threads vLLM leaves running in this
process (see ``close``), so that the interpreter's teardown finds none of them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from common.vllm_memory import EngineStartRefused, check_start, choose_share, start_refusal
from common.vllm_spin import IDLE_SPIN_ENV

log = logging.getLogger(__name__)

GPU_MEMORY_SHARE = 0.9  # --ref_gpu_memory_utilization on GPUs when not given (CPU: common/vllm_memory.py)
MEMORY_FLAG = "--ref_gpu_memory_utilization"
CLOSE_JOIN_S = 10.0  # how long close() waits for vLLM's client threads once the engine is down


class VLLMReferenceScorer:
    def __init__(self, llm: Any, vocab_size: int) -> None:
        self.llm = llm
        self._vocab_size = vocab_size
        self.idle_spin_s: float | None = None  # what its workers' queues spin (read at load)
        self.memory_share: float | None = None  # the share the engine was started with

    @classmethod
    def load(
        cls,
        path: str,
        *,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        idle_spin_s: float | None = None,
        who: str = "reward service",
        flag: str = MEMORY_FLAG,
    ) -> VLLMReferenceScorer:
        """``gpu_memory_utilization``: None for this host's default (module doc); ``idle_spin_s``:
        how long the workers poll after their last step (``--ref_idle_spin_s``; None:
        ``IDLE_SPIN_ENV`` if set, else vLLM's own). Raises EngineStartRefused where vLLM-CPU
        would refuse the share (before any engine process starts, or after it did)."""
        from vllm import LLM

        share = choose_share(gpu_memory_utilization, GPU_MEMORY_SHARE, model=path, flag=flag, who=who)
        check_start(share, model=path, flag=flag, who=who)

        if idle_spin_s is not None:  # read by reward_service.ref_worker_ext in the workers vLLM spawns
            os.environ[IDLE_SPIN_ENV] = str(idle_spin_s)
        kw: dict[str, Any] = {}
        if max_model_len:
            kw["max_model_len"] = max_model_len
        if not torch.cuda.is_available():
            # vLLM 0.32 on CPU kills the engine when a request is chunk-prefilled with
            # prompt log-probs on; a reference forward is one prefill per sequence anyway.
            kw["enable_chunked_prefill"] = False
        try:
            llm = LLM(
                model=path,
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=share,
                enforce_eager=enforce_eager,
                # Every request is a different sequence scored once: a prefix cache would only
                # hold memory (and prompt log-probs are not served from it).
                enable_prefix_caching=False,
                seed=seed,
                worker_extension_cls="reward_service.ref_worker_ext.RefWorkerExtension",
                **kw,
            )
        except RuntimeError as e:
            # vLLM's worker raised in its own process; the memory check, read again, says
            # whether it was the share (memory taken since check_start ran).
            if "initialization failed" in str(e):
                refused = start_refusal(share, model=path, flag=flag, who=who)
                if refused is not None:
                    raise EngineStartRefused(refused) from None
            raise
        vocab = llm.llm_engine.model_config.get_vocab_size()
        scorer = cls(llm, vocab)
        scorer.memory_share = share
        scorer.idle_spin_s = llm.collective_rpc("rayless_idle_spin_s")[0]
        log.info(
            "scoring model %s on vLLM (tp %d, %s, %s %.2f), idle spin %s s",
            path,
            tensor_parallel_size,
            dtype,
            flag,
            share,
            scorer.idle_spin_s,
        )
        return scorer

    def close(self) -> None:
        """Stops the engine's processes, then what vLLM's client leaves running in this one.

        ``SyncMPClient.shutdown`` (vLLM 0.32) stops the engine core, closes its input socket
        and *asks* its output thread (``EngineCoreOutputQueueThread``, a daemon blocked in a
        ZeroMQ poll) to close the output socket, without waiting for it; the ZeroMQ context
        it made (two I/O threads and a reaper) is never terminated, and no atexit hook of
        vLLM's covers either. After a clean run the thread was still running in 2 of 3 closes
        measured here, so the interpreter's teardown began beside a daemon thread inside
        pyzmq and libzmq's threads working on its sockets: the point where CI's exits died of
        SIGABRT ("terminate called without an active exception", C++'s std::terminate; never
        reproduced locally) -- an exit code a supervisor reads as a crash. Here the thread is
        joined and the context destroyed: the process leaves with no thread of vLLM's
        running. Safe to call twice."""
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is None:
            return
        core.shutdown()
        thread = getattr(core, "output_queue_thread", None)
        if thread is not None:
            thread.join(CLOSE_JOIN_S)
            if thread.is_alive():
                log.warning("vLLM's output thread did not stop within %.0f s of the engine's shutdown", CLOSE_JOIN_S)
                return  # destroying the context under its sockets could hang: leave it to exit
        ctx = getattr(core, "ctx", None)
        if ctx is not None and not ctx.closed:
            ctx.destroy(linger=0)
        log.info("reference engine stopped; its client's output thread and ZeroMQ context are closed too")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # the log-probs come back as host tensors

    @torch.no_grad()
    def logprobs(self, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> torch.Tensor:
        """Log-probs of every response token, concatenated in input order: ``(L,)`` float32."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"sample {i} has an empty prompt: its first response token has no context")
        seqs = [[*p.tolist(), *r.tolist()] for p, r in zip(prompts, responses, strict=True)]
        todo = [i for i, r in enumerate(responses) if len(r)]  # an empty response has no log-probs
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=seqs[i]) for i in todo], params, use_tqdm=False)
        per_sample: list[list[float]] = [[] for _ in prompts]
        for i, out in zip(todo, outs, strict=True):
            seq, start = seqs[i], len(prompts[i])
            # prompt_logprobs[t]: {token at t: its log-prob given tokens < t} (None at t = 0)
            per_sample[i] = [out.prompt_logprobs[t][seq[t]].logprob for t in range(start, len(seq))]
        return torch.tensor([x for row in per_sample for x in row], dtype=torch.float32)  # (L,)
