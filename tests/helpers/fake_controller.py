"""Stand-ins for in-process service tests: a controller that welcomes every Hello, acts once
after the first heartbeat and records everything else until an Ack or a fatal notice (or
15 s); and a scorer that is never asked to score (for the reward server's shell)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from common import protocol as P
from common.transport import Endpoint


def welcome_then(
    router: Endpoint, after_first_heartbeat: Callable[[Endpoint, bytes], None], seen: list[P.Message]
) -> threading.Thread:
    """Starts the controller thread on ``router``; ``after_first_heartbeat(router, identity)``
    is called once; what the service sends (Hellos aside) lands in ``seen``."""

    def run() -> None:
        deadline, acted = time.monotonic() + 15, False
        while time.monotonic() < deadline:
            got = router.recv(timeout=0.1)
            if got is None:
                continue
            ident, msg = got
            if isinstance(msg, P.Hello):
                router.reply(msg, P.Welcome(peer_id=msg.name), to=ident)
                continue
            seen.append(msg)
            if isinstance(msg, P.Heartbeat) and not acted:
                acted = True
                after_first_heartbeat(router, ident)
            if isinstance(msg, P.Ack) or (isinstance(msg, P.Error) and msg.code == "fatal"):
                return

    t = threading.Thread(target=run)
    t.start()
    return t


class IdleScorer:
    """A reward service's Scorer that is never asked to score."""

    def score(self, req):
        raise AssertionError("not asked to score")

    def capabilities(self):
        return P.RewardCapabilities(sources=["func:idle.py"])

    def stats(self):
        return {}

    def close(self):
        pass
