"""``python -m reward_service.serve_rm --reward.model_name_or_path RM``: a reward model over HTTP.

OpenRLHF's ``serve_rm`` command, so a reward model can sit on its own machine and any number of
trainers reach it with ``--remote_rm_url http://HOST:PORT/get_reward`` (rayless's reward service,
``reward_service/remote.py``, or OpenRLHF's). The wire format is OpenRLHF's:

- request: ``POST /get_reward`` with a JSON object whose ``query`` is a list of strings (prompt +
  response text, one per sample); ``prompts`` and ``labels``, which both clients also send, are
  not read (as in OpenRLHF: a reward model scores the whole text);
- answer: ``{"rewards": [N floats], "scores": [the same], "extra_logs": {}}``.

The scoring is the reward service's own (``reward_service.reward_model.RewardModelScorer``): the
head read at the last non-pad token, position ids from the mask, length-sorted micro-batches, so
a query scores as it would under ``python -m reward_service --reward_pretrain RM --rm_from_text``.
The text is tokenised by the RM's own tokenizer without special tokens and cut to
``--data.max_len`` tokens (OpenRLHF's ``truncation=True``: the tokenizer's side, the end for most).

How it differs from OpenRLHF's:

- it listens on 127.0.0.1 unless ``--host`` says otherwise (OpenRLHF: 0.0.0.0), and warns when
  the address is wider: nothing authenticates a client;
- defaults suited to a CPU as well as a GPU: fp32 (``--bf16`` / ``--ds.param_dtype bf16`` as
  OpenRLHF's default), SDPA attention (``--flash_attn`` asks for FlashAttention-2, taken when
  CUDA and the flash_attn package are there), the head's name found in the checkpoint
  (``--value_head_prefix auto``: the config's ``value_head_prefix``, ``score``, ``value_head``);
- a bad request (not JSON, no ``query``, a non-string entry, a text with no tokens, a body over
  ``--max_body_mb``) is answered 4xx with ``{"error": ..., "field": ...}`` naming the field; a
  forward that raised is a 500; the server keeps serving either way;
- ``extra_logs`` is empty (OpenRLHF's repeats the rewards as ``dummy_scores``, which a trainer
  would log as a metric of its own).

``GET /health`` answers ``{"status": "ok"}`` once the model is loaded (a probe for a supervisor).
The model runs one request at a time (a lock; each forward uses every core torch is given);
requests are read and answered on their own threads. Exit codes as every service's
(``common/service.py``): 2 when it cannot start (a flag, the model, the port), 128 + N on signal N.

This module imports nothing heavy: the flags parse before torch loads, so ``--help`` is instant.
The HTTP server and the scoring core are ``reward_service/rm_http.py``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.config import flag, parse, section

log = logging.getLogger("reward_service.serve_rm")

DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class RewardSection:
    """The reward model (OpenRLHF's ``reward.*``)."""

    model_name_or_path: str = flag(
        "",
        "the reward model: a local HF directory or hub name (sequence classifier, or OpenRLHF's value-head format)",
        required=True,
        flat="reward_pretrain",
    )
    normalize_enable: bool = flag(
        False,
        "rewards become (r - mean) / std with mean and std from the RM's config.json (the RM trainer writes them)",
        flat="normalize_reward",
    )


@dataclass
class DSSection:
    """The model's numerics (OpenRLHF's ``ds.*``)."""

    param_dtype: str = flag(
        "fp32",
        "dtype the model runs in: fp32 (rayless's default, fine on CPUs), bf16 (OpenRLHF's default) or fp16; "
        "rewards are returned as float32 either way",
        choices=DTYPES,
        flat="bf16",
        flat_const="bf16",
    )
    attn_implementation: str = flag(
        "sdpa",
        "attention kernel: sdpa, eager, or flash_attention_2 (CUDA + flash_attn; SDPA with a notice otherwise)",
        flat="flash_attn",
        flat_const="flash_attention_2",
    )
    value_head_prefix: str = flag(
        "auto",
        "name of the RM's scalar head in the checkpoint; auto: the config's value_head_prefix, then score, value_head",
        flat="value_head_prefix",
    )
    load_in_4bit: bool = flag(
        False,
        "load the model in 4 bits (bitsandbytes)",
        flat="load_in_4bit",
        inert="4-bit loading is a GPU feature rayless does not build yet (issue 38); the model loads in "
        "--ds.param_dtype",
    )
    packing_samples: bool = flag(
        False,
        "pack the request's samples into one row",
        flat="packing_samples",
        inert="the reward model pads length-sorted micro-batches (same rewards; packing needs varlen kernels)",
    )
    experts_implementation: str = flag(
        "", "MoE expert kernel", inert="MoE kernels are not built in rayless; transformers' default runs"
    )

    def __post_init__(self) -> None:
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2", "flash_attention_3"):
            raise ValueError(
                f"--ds.attn_implementation {self.attn_implementation}: one of sdpa, eager, flash_attention_2"
            )


@dataclass
class DataSection:
    """How text becomes tokens (OpenRLHF's ``data.*``)."""

    max_len: int = flag(2048, "a query is cut to this many tokens before scoring", flat="max_len")
    disable_fast_tokenizer: bool = flag(
        False, "use the RM's slow (Python) tokenizer instead of its fast one", flat="disable_fast_tokenizer"
    )

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError(f"--data.max_len (--max_len) must be >= 1, got {self.max_len}")


@dataclass
class ServeRMConfig:
    reward: RewardSection = section(RewardSection, "the reward model")
    ds: DSSection = section(DSSection, "the model's numerics")
    data: DataSection = section(DataSection, "tokenisation")
    host: str = flag(
        "127.0.0.1",
        "address to listen on; 127.0.0.1: this machine only. A wider one (0.0.0.0, OpenRLHF's default) "
        "serves anyone who can reach the port, with no authentication (a warning at start-up)",
    )
    port: int = flag(5000, "TCP port to listen on (0: one the OS picks, logged at start-up)")
    batch_size: int | None = flag(
        None, "sequences per model forward (length-sorted); default: a whole request in one forward, as OpenRLHF"
    )
    device: str = flag("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    max_body_mb: float = flag(
        64.0, "a request body larger than this is refused (413) before it is read: memory stays bounded"
    )
    use_ms: bool = flag(
        False,
        "download the model from ModelScope",
        inert="ModelScope's hub is not wired in; give a local path or a Hugging Face name",
    )
    log_level: str = flag(
        "INFO", "logging level (DEBUG logs every request)", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    # what cannot act here, one line per flag given (common.config fills in the inert flags'),
    # logged once logging is up
    notices: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {self.batch_size}")
        if not self.max_body_mb > 0:
            raise ValueError(f"--max_body_mb must be > 0, got {self.max_body_mb}")


def parse_config(argv: Sequence[str] | None = None) -> ServeRMConfig:
    """argv -> validated config; a bad flag prints the usage and exits 2."""
    return parse(
        ServeRMConfig,
        argv,
        description="A reward model served over HTTP in OpenRLHF's serve_rm format (POST /get_reward), for "
        "--remote_rm_url. See docs/reward.md.",
        prog="python -m reward_service.serve_rm",
    )


def main(argv: Sequence[str] | None = None) -> int:
    from common.config import log_config

    cfg = parse_config(argv)
    logging.basicConfig(
        level=cfg.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s serve_rm[%(process)d] %(name)s: %(message)s",
    )
    log_config(cfg, log)
    for line in cfg.notices:
        log.warning("inert: %s", line)
    from reward_service.rm_http import run  # torch and transformers load from here on

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
