"""``python -m reward_service --controller tcp://HOST:PORT [sources...]``: one reward service.

Parses the config before importing torch or transformers, so ``--help`` is instant; logs
the resolved config as JSON; then loads the models / reward functions and serves
(``reward_service/server.py``). Exit codes, the rule both services share (``common/service.py``):
0 stopped by the controller (Shutdown, its fatal notice), 1 a fatal fault, 2 could not start
(the log names the file or flag at fault), 3 no controller, 128 + N stopped by signal N.
"""

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from common.config import log_config
    from reward_service.config import parse_config

    cfg = parse_config(argv)
    logging.basicConfig(
        level=cfg.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s reward[%(process)d] %(name)s: %(message)s",
    )
    log_config(cfg, logging.getLogger("reward_service"))
    from reward_service.server import serve  # the heavy imports start here

    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
