"""Configuration of one reward service process: a dataclass, generated into argparse.

Every flag is a field below with a one-line help; ``parse_config`` builds the CLI from the
fields, so the two never drift apart. This module imports nothing heavy (no torch, no
transformers): ``python -m reward_service --help`` answers before any of that loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import types
import typing
from dataclasses import dataclass, field


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class RewardConfig:
    # -- wiring
    controller: str = _f(None, "address of the controller's ROUTER socket, e.g. tcp://10.0.0.1:5555 (required)")
    name: str = _f("", "this service's name at the controller (its ZMQ identity); default reward-HOST-PID")
    heartbeat_s: float = _f(2.0, "seconds between Heartbeat messages to the controller")
    connect_timeout_s: float = _f(60.0, "give up if the controller does not answer Hello within this many seconds")
    capacity: int = _f(
        64, "prompts the controller may have in flight here (announced in Hello as capabilities['capacity'])"
    )
    max_pending: int = _f(64, "ScoreRequests queued beyond this are refused with Error(code='overloaded')")

    # -- reference model (KL term)
    ref_pretrain: str | None = _f(None, "HF causal LM path: return per-token reference log-probs of each response")
    temperature: float = _f(
        1.0, "divide reference logits by this before log-softmax (use the policy's sampling temperature)"
    )

    # -- reward model
    reward_pretrain: str | None = _f(None, "HF reward model path (sequence classifier or OpenRLHF value-head format)")
    value_head_prefix: str = _f(
        "auto",
        "name of the RM's scalar head in the checkpoint; auto: config's value_head_prefix, then 'score', 'value_head'",
    )
    normalize_reward: bool = _f(False, "RM rewards become (r - config.mean) / config.std, from the RM's config.json")
    rm_from_text: bool = _f(
        False, "feed the RM the query text re-tokenised by its own tokenizer (RM tokenizer differs from policy's)"
    )

    # -- rule / function rewards and remote rewards
    reward_func: str | None = _f(
        None, "path to a .py defining reward_func(queries, prompts, labels, **kw) (OpenRLHF contract)"
    )
    remote_rm_url: str | None = _f(
        None,
        "comma-separated http(s) URLs of reward servers (OpenRLHF serve_rm format); a .py entry is a reward_func file",
    )
    timeout_s: float = _f(30.0, "per-call deadline of a reward function or one HTTP attempt; past it the samples fail")
    retries: int = _f(3, "HTTP retries after the first attempt (rotating over the URLs), with exponential backoff")
    retry_backoff_s: float = _f(
        0.5, "first HTTP retry waits this long; each further retry waits twice as long (capped at 8 s)"
    )
    func_workers: int = _f(1, "worker processes running reward_func; a batch is split across them")

    # -- models
    tokenizer: str | None = _f(
        None, "tokenizer of the policy, to decode token ids into text (default: --ref_pretrain, else --reward_pretrain)"
    )
    micro_batch_size: int = _f(8, "sequences per forward pass of the reference / reward model (length-sorted, padded)")
    bf16: bool = _f(False, "load models in bfloat16 (log-probs and rewards are still returned in float32)")
    device: str = _f("auto", "torch device for the models: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    attn_implementation: str | None = _f(
        None, "passed to from_pretrained (sdpa, eager, flash_attention_2); default: transformers' choice"
    )

    log_level: str = _f("INFO", "logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    # ------------------------------------------------------------------ derived
    def func_files(self) -> list[str]:
        """Reward-function files: --reward_func plus .py entries of --remote_rm_url."""
        files = [self.reward_func] if self.reward_func else []
        return files + [u for u in _split(self.remote_rm_url) if u.endswith(".py")]

    def urls(self) -> list[str]:
        return [u for u in _split(self.remote_rm_url) if not u.endswith(".py")]

    def tokenizer_path(self) -> str | None:
        return self.tokenizer or self.ref_pretrain or self.reward_pretrain

    def validate(self) -> None:
        """Raises ValueError naming the flag at fault."""
        if not self.controller:
            raise ValueError("--controller is required (the controller's address, e.g. tcp://127.0.0.1:5555)")
        if not (self.ref_pretrain or self.reward_pretrain or self.func_files() or self.urls()):
            raise ValueError(
                "nothing to score with: give --ref_pretrain, --reward_pretrain, --reward_func or --remote_rm_url"
            )
        if self.normalize_reward and not self.reward_pretrain:
            raise ValueError("--normalize_reward applies to a reward model: give --reward_pretrain")
        if self.rm_from_text and not (self.tokenizer or self.ref_pretrain):
            raise ValueError("--rm_from_text re-tokenises text decoded with the policy's tokenizer: give --tokenizer")
        for u in self.urls():
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"--remote_rm_url entry {u!r} is neither an http(s) URL nor a .py file")
        for name in ("micro_batch_size", "func_workers", "max_pending", "capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout_s", "heartbeat_s", "connect_timeout_s", "temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0 or self.retry_backoff_s < 0:
            raise ValueError("--retries and --retry_backoff_s must be >= 0")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _split(csv: str | None) -> list[str]:
    return [s.strip() for s in (csv or "").split(",") if s.strip()]


def _base_type(tp):
    """``str | None`` -> ``str``; plain types pass through."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m reward_service",
        description="Reward service: reference log-probs, reward models, rule functions and remote HTTP rewards "
        "for the rayless controller. See docs/reward.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(RewardConfig)
    for f in dataclasses.fields(RewardConfig):
        tp = _base_type(hints[f.name])
        kw = {"help": f.metadata["help"], "default": f.default}
        if tp is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = tp
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        p.add_argument(f"--{f.name}", **kw)
    return p


def parse_config(argv: list[str] | None = None) -> RewardConfig:
    """argv -> validated RewardConfig; exits with a usage error on a bad flag."""
    p = build_parser()
    args = p.parse_args(argv)
    cfg = RewardConfig(**vars(args))
    cfg.name = cfg.name or f"reward-{socket.gethostname()}-{os.getpid()}"  # as common.transport.default_name
    for path_flag in ("reward_func",):
        v = getattr(cfg, path_flag)
        if v:
            setattr(cfg, path_flag, os.path.abspath(v))
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return cfg
