"""Child process that runs a user's ``reward_func``: one per ``--func_workers`` slot.

Run by ``reward_service/func_reward.py`` as ``python func_worker.py --fd N FILE`` (by path,
not ``-m``: it imports only the standard library and msgspec, so it starts fast and does
not need the package on ``sys.path``). Why a process and not a thread: a reward function
that hangs (an infinite loop, a stuck subprocess, a C extension that never returns) cannot
be stopped inside a process, only killed from outside; the service then starts a fresh one.

Protocol over the socket ``--fd`` (multiprocessing framing, msgpack bodies, never pickle):
- after loading FILE: ``{"ok": true}`` or ``{"error": "why"}`` (then exit 1);
- then per call: parent sends ``{"queries", "prompts", "labels", "kw"}``, child answers
  ``{"ok": true, "result": <plain lists/dicts/numbers>}`` or ``{"error": "Type: message"}``.
The user's prints go to this process's stdout/stderr, i.e. the service's log.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import traceback
from multiprocessing.connection import Connection

import msgspec


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the service dies, so a hung function is never orphaned.
    (``common.child_process.die_with_parent``'s twin: this file is run by path, without the package.)"""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no glibc (other OSes): the parent's kill on shutdown still applies
        pass


def load_reward_func(path: str):
    """The ``reward_func`` callable of FILE; raises RuntimeError naming the file and what is wrong."""
    if not os.path.isfile(path):
        raise RuntimeError(f"reward function file {path} does not exist")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # let it import its sibling modules
    spec = importlib.util.spec_from_file_location("reward_func_module", path)
    if spec is None or spec.loader is None:  # a suffix no import loader knows (not .py, .pyc, ...)
        raise RuntimeError(f"reward function file {path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - a SystemExit in user code is a load error too
        raise RuntimeError(f"importing {path} raised {type(e).__name__}: {e}\n{traceback.format_exc()}") from None
    fn = getattr(module, "reward_func", None)
    if fn is None:
        raise RuntimeError(
            f"{path} defines no `reward_func` (expected def reward_func(queries, prompts, labels, **kw))"
        )
    if not callable(fn):
        raise RuntimeError(f"{path}: `reward_func` is a {type(fn).__name__}, not a function")
    return fn


def accepted_kwargs(fn) -> set[str] | None:
    """Names of keyword arguments ``fn`` takes beyond the three positional ones; None = any (**kw)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {p.name for p in named[3:]} | {p.name for p in params if p.kind is p.KEYWORD_ONLY}


def plain(x):
    """Tensors / arrays / tuples -> lists, recursively, so msgpack can carry the result."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if hasattr(x, "tolist"):  # torch.Tensor, numpy array or scalar
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def serve(conn: Connection, fn) -> None:
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    takes = accepted_kwargs(fn)
    while True:
        try:
            req = dec.decode(conn.recv_bytes())
        except EOFError:
            return  # the service closed the socket: shut down
        kw = req.get("kw") or {}
        if takes is not None:
            kw = {k: v for k, v in kw.items() if k in takes}
        try:
            result = plain(fn(req["queries"], req["prompts"], req["labels"], **kw))
        except BaseException as e:  # noqa: BLE001 - report anything, keep serving
            tb = traceback.format_exc(limit=-3)
            conn.send_bytes(enc.encode({"error": f"reward_func raised {type(e).__name__}: {e}", "traceback": tb}))
            continue
        try:
            body = enc.encode({"ok": True, "result": result})
        except (TypeError, OverflowError) as e:
            body = enc.encode({"error": f"reward_func returned a value that is not numbers/lists/dicts: {e}"})
        conn.send_bytes(body)


def main() -> None:
    p = argparse.ArgumentParser(description="reward_func worker (started by the reward service)")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("file")
    args = p.parse_args()
    _die_with_parent()
    conn = Connection(args.fd)
    enc = msgspec.msgpack.Encoder()
    try:
        fn = load_reward_func(args.file)
    except RuntimeError as e:
        conn.send_bytes(enc.encode({"error": str(e)}))
        sys.exit(1)
    conn.send_bytes(enc.encode({"ok": True}))
    serve(conn, fn)


if __name__ == "__main__":
    main()
