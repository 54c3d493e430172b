"""What an RL run reports: metrics.jsonl (launch.local's progress line reads it), TensorBoard,
Weights & Biases (``--use_wandb``), and the one-line step summary in the log. Rank 0 only."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from learner.rl.config.sections import PPOLoggerSection
from learner.runtime.metrics import MetricsWriter

log = logging.getLogger("learner")


def metrics_writer(logger: PPOLoggerSection, output_dir: str, config: Mapping[str, Any]) -> MetricsWriter:
    """--metrics_file (default OUTPUT_DIR/metrics.jsonl), TensorBoard in --use_tensorboard (default
    OUTPUT_DIR/tensorboard), and wandb with --use_wandb (its folder beside the metrics file);
    ``config``: the run's config as the trackers record it (secrets redacted)."""
    from learner.runtime.wandb_sink import wandb_sink

    out = Path(output_dir)
    path = Path(logger.metrics_file or out / "metrics.jsonl")
    wandb = wandb_sink(logger.wandb, trainer="train_ppo", config=config, folder=path.parent)
    return MetricsWriter(path, logger.tensorboard_dir or out / "tensorboard", wandb=wandb)


def run_metrics(controller: Any, batch: Any, n_samples: int, timings: dict[str, float]) -> dict[str, float]:
    """The data path's counters for one step (``batch``: the step's ``learner.rl.driver.StepBatch``),
    and the reward function's and the agent's own logs; ``timings``: generate_s, train_s, step_s,
    eta_s, total_steps."""
    out = {
        "time/generate_s": timings["generate_s"],
        "time/train_s": timings["train_s"],
        "time/step_s": timings["step_s"],
        "time/eta_s": timings["eta_s"],
        "time/total_steps": timings["total_steps"],
        "perf/rollout_tokens_per_s": batch.generated_tokens / max(timings["generate_s"], 1e-6),
        "ledger/reissued": controller.ledger.counters["reissued"],
        "ledger/duplicates": controller.ledger.counters["duplicates"],
        "ledger/failed_groups": batch.failed_groups,
        "pool/died": controller.pool.counters["died"],
        "pool/rollout_servers": len(controller.pool.alive("rollout")),
        "samples": n_samples,
        **agent_metrics(controller, batch.rollout.samples),
    }
    return {**out, **extra_log_metrics(batch.rollout.samples, taken=out)}


def agent_metrics(controller: Any, samples: list[Any]) -> dict[str, float]:
    """Agent episodes' shape (none without an agent): actions per episode, environment tokens
    per episode (context, not trained: rollout/response_len counts the policy's tokens only),
    the episodes that failed so far (the environment raised, hung or answered garbage), and the
    prefix-cache hit rate of later turns the rollout servers report."""
    episodes = [s for s in samples if s.turns]
    if not episodes:
        return {}
    env = [len(s.response) - s.action_len for s in episodes]
    out = {
        "agent/turns": sum(s.turns for s in episodes) / len(episodes),
        "agent/env_tokens": sum(env) / len(episodes),
        "agent/failed_episodes": controller.counters["failed_episodes"],
    }
    # The rollout servers' own count, from their last heartbeats (run totals): the share of later
    # turns' input that vLLM's prefix cache held.
    stats = [p.stats for p in controller.pool.alive("rollout")]
    later = sum(st.get("agent_later_turn_tokens", 0.0) for st in stats)
    if later:
        out["agent/prefix_cache_hit"] = sum(st.get("agent_later_turn_cached", 0.0) for st in stats) / later
    return out


def extra_log_metrics(samples: list[Any], taken: Collection[str] = ()) -> dict[str, float]:
    """The ``extra_logs`` of the reward function(s) and of the agent (``ScoredSample.reward_logs``,
    ``.agent_logs``) as their means over the step's samples, ``reward/<name>`` and
    ``agent/<name>`` (OpenRLHF logs them too). Each mean is over the samples that logged the
    name (NaN: one that did not). A name already under its prefix stays as it is (the reward
    service's ``reward/<source>``, each source's own reward when several are summed); one that
    would replace a metric of rayless's own (``taken``, e.g. ``agent/turns``) is logged as
    ``<prefix>/extra/<name>`` instead."""
    acc: dict[str, list[float]] = {}
    for s in samples:
        for prefix, logs in (("reward", s.reward_logs), ("agent", s.agent_logs)):
            for name, v in logs.items():
                if math.isfinite(v):
                    key = name if name.startswith(f"{prefix}/") else f"{prefix}/{name}"
                    if key in taken:
                        key = f"{prefix}/extra/{name}"
                    total = acc.setdefault(key, [0.0, 0.0])
                    total[0] += v
                    total[1] += 1
    return {k: total / n for k, (total, n) in acc.items()}


def log_step(step: int, total_steps: int, metrics: dict[str, Any]) -> None:
    value = f" value_loss {metrics['critic/value_loss']:.4f}" if "critic/value_loss" in metrics else ""
    # absent when no trained sample came from the trained weights (async, every sample lagging)
    diff = metrics.get("rollout/logprob_diff")
    log.info(
        "step %d/%d reward %.3f logprob_diff %s kl %.4f gen %.1fs train %.1fs%s",
        step,
        total_steps,
        metrics["rollout/reward"],
        f"{diff:.2e}" if diff is not None else "n/a (no lag-0 sample)",
        metrics["policy/kl_to_ref"],
        metrics["time/generate_s"],
        metrics["time/train_s"],
        value,
    )
