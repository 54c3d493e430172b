"""``python -m rollout_service --model PATH --controller tcp://HOST:PORT [...]``

One vLLM engine behind ZeroMQ: says Hello to the controller, then turns PromptBatches into
SampleBatches and takes weight updates from the learner. Flags: ``rollout_service/config.py``
(``--help``). The config is parsed before torch or vLLM is imported, so ``--help`` is instant.
"""

from __future__ import annotations

import logging
import sys

from common.config import log_config, parse
from rollout_service.config import RolloutConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse(
        RolloutConfig,
        argv,
        description="One vLLM engine behind ZeroMQ: prompts in, samples out, live weight updates.",
        prog="python -m rollout_service",
    )
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_config(cfg, logging.getLogger("rollout_service"))
    from rollout_service.server import run  # heavy: torch, vLLM

    return run(cfg)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import __main__
    sys.exit(main())
