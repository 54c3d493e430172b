"""common.sandbox: model-written code in fresh, isolated, limited processes.

Each hostile program (an infinite loop, a CPU spin, a fork bomb, a memory bomb, a write outside its
directory, a socket, a read of the run's CURVE keys, gigabytes of output) must end as that call's
failure with its reason, leave nothing behind, and leave the sandbox serving the next call. Run in
both modes this host gives: "auto" (namespaces where the host allows them; root here) and the
"process" fallback (resource limits and an audit hook, for hosts without namespaces). Small limits
keep each case to about a second.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time

import pytest

from common.sandbox import Sandbox, SandboxError, SandboxLimits

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1.0, memory_mb=128, max_procs=8, max_output_bytes=64 << 10, disk_mb=8)


@pytest.fixture(scope="module", params=["auto", "process"])
def sandbox(request):
    sb = Sandbox(workers=2, limits=LIMITS, isolation=request.param)
    yield sb
    sb.close()


def _alive_after(sb: Sandbox) -> None:
    """Nothing else touched: the next call is served as usual."""
    r = sb.run_sync("print(input() * 2)", stdin="ab")
    assert (r.reason, r.stdout) == ("ok", "abab\n"), r


def test_runs_code_with_stdin_and_reports_exit(sandbox):
    r = sandbox.run_sync("import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="1 2 3")
    assert (r.reason, r.exit_code, r.stdout) == ("ok", 0, "6\n")
    assert r.isolation == sandbox.isolation != "auto"
    r = sandbox.run_sync("raise ValueError('bad')")
    assert (r.reason, r.exit_code) == ("exit", 1) and "ValueError: bad" in r.stderr
    r = sandbox.run_sync("import sys; sys.exit(3)")
    assert (r.reason, r.exit_code) == ("exit", 3)
    r = sandbox.run_sync("import os; print(os.getcwd() == os.environ['HOME'], sorted(os.environ))")
    assert r.stdout == "True ['HOME', 'LANG', 'PATH', 'TMPDIR']\n"  # the service's environment is not there
    r = sandbox.run_sync("from dataclasses import dataclass\n@dataclass\nclass P:\n    x: 'int'\nprint(P(1))")
    assert r.stdout == "P(x=1)\n", r  # its own __main__ module


def test_infinite_loop_is_killed_at_the_wall_limit(sandbox):
    t0 = time.monotonic()
    r = sandbox.run_sync("import time\nwhile True: time.sleep(0.01)", timeout_s=0.5)
    assert r.reason == "timeout" and r.exit_code is None, r
    assert time.monotonic() - t0 < 3
    _alive_after(sandbox)


def test_cpu_spin_stops_at_the_cpu_limit(sandbox, request):
    if request.node.callspec.params["sandbox"] == "process":
        pytest.skip("RLIMIT_CPU acts the same in every mode: checked once (a second of CPU is slow on a busy host)")
    r = sandbox.run_sync("while True: pass", limits=LIMITS.replace(cpu_s=1, wall_s=15))
    assert r.reason == "cpu_time", r
    _alive_after(sandbox)


def test_fork_bomb_is_refused(sandbox):
    r = sandbox.run_sync("import os\nwhile True:\n    os.fork()")
    # namespaces: RLIMIT_NPROC under a uid of its own; process mode as root: fork is refused outright
    assert r.reason in ("processes", "exit") and r.reason == ("processes" if r.isolation != "process" else r.reason)
    assert "BlockingIOError" in r.stderr or "os.fork is not allowed" in r.stderr, r
    _alive_after(sandbox)


def test_memory_bomb_hits_the_memory_limit(sandbox):
    r = sandbox.run_sync("x = []\nwhile True:\n    x.append(bytearray(16 << 20))")
    assert r.reason == "memory" and "MemoryError" in r.stderr, r
    _alive_after(sandbox)


def test_writes_outside_its_directory_fail(sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    r = sandbox.run_sync(f"open({str(target)!r}, 'w').write('x')")
    assert r.reason == "exit" and not target.exists(), r
    r = sandbox.run_sync("open('mine.txt', 'w').write('x' * 100); print(open('mine.txt').read().count('x'))")
    assert (r.reason, r.stdout) == ("ok", "100\n")  # its own directory is writable
    r = sandbox.run_sync("import os; print(os.path.exists('mine.txt'))")
    assert r.stdout == "False\n"  # and fresh per call


def test_no_network(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    try:
        r = sandbox.run_sync(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert r.reason == "exit", r
        assert "Network is unreachable" in r.stderr or "not allowed" in r.stderr, r.stderr
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the host's loopback
    finally:
        server.close()


def test_cannot_read_the_runs_keys(sandbox, tmp_path):
    from common.auth import keygen

    keys = keygen(tmp_path / "auth")
    secret = keys / "controller.key_secret"
    code = f"print(open({str(secret)!r}).read())"
    r = sandbox.run_sync(code)
    assert r.reason == "exit" and "secret-key" not in r.stdout, r
    assert "FileNotFoundError" in r.stderr or "PermissionError" in r.stderr


def test_gigabytes_of_output_are_cut_and_killed(sandbox):
    t0 = time.monotonic()
    r = sandbox.run_sync("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert r.reason == "output_limit" and r.truncated, r
    assert len(r.stdout) + len(r.stderr) <= LIMITS.max_output_bytes
    assert time.monotonic() - t0 < 2
    _alive_after(sandbox)


def test_a_timed_out_call_leaves_no_process_behind():
    """Killed whole: a child the code started dies with it (namespace modes: the PID namespace)."""
    with Sandbox(workers=1, limits=LIMITS) as sb:
        if sb.isolation == "process":
            pytest.skip("process mode refuses subprocesses; killpg covers its forks")
        marker = "987.125"
        r = sb.run_sync(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nwhile True: pass", timeout_s=0.5)
        assert r.reason == "timeout"
        time.sleep(0.1)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert marker.encode() not in f.read(), f"sleep {marker} (pid {pid}) outlived its sandbox"
            except OSError:
                continue


def test_concurrent_calls_from_an_event_loop():
    with Sandbox(workers=2, limits=LIMITS) as sb:

        async def many():
            return await asyncio.gather(*(sb.run(f"print({i} * {i})") for i in range(8)))

        results = asyncio.run(many())
        assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]
        assert [r.stdout for r in sb.run_many_sync([("print(input())", str(i)) for i in range(4)])] == [
            f"{i}\n" for i in range(4)
        ]


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="SandboxLimits.wall_s"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="unknown sandbox limit"):
        LIMITS.replace(wal_s=1)
    with pytest.raises(SandboxError, match="language 'rust'"):
        Sandbox(language="rust")
    with pytest.raises(SandboxError, match="isolation 'docker'"):
        Sandbox(isolation="docker")
    with pytest.raises(SandboxError, match="workers"):
        Sandbox(workers=0)


def _children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_killed_fork_server_is_restarted():
    with Sandbox(workers=1, limits=LIMITS) as sb:
        assert sb.run_sync("print(1)").ok
        old = sb._server_proc
        old.kill()
        time.sleep(0.2)
        results = [sb.run_sync("print(2)") for _ in range(3)]  # the warm worker, then fresh ones
        assert [r.stdout for r in results] == ["2\n"] * 3, results
        assert sb._server_proc is not old


def test_the_services_death_takes_every_sandbox_process_with_it():
    """SIGKILL the process that owns a Sandbox: its fork server and warm workers die too (parent-death signals)."""
    import subprocess

    script = (
        "import sys, time\nsys.path.insert(0, sys.argv[1])\nfrom common.sandbox import Sandbox\n"
        "sb = Sandbox(workers=2)\nprint(sb._server_proc.pid, flush=True)\ntime.sleep(60)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    owner = subprocess.Popen([sys.executable, "-c", script, root], stdout=subprocess.PIPE, text=True)
    try:
        server = int(owner.stdout.readline())
        deadline = time.monotonic() + 10
        while len(_children(server)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = _children(server)
        family = {server} | workers | {c for w in workers for c in _children(w)}
        assert len(workers) == 2, workers
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in family if _alive(p)], "sandbox processes outlived the service"


NOBODY_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from common.sandbox import Sandbox, SandboxLimits
codes = {
    "ok": "print(2 + 2)",
    "socket": "import socket\\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    "fork_bomb": "import os\\nwhile True:\\n    os.fork()",
    "write_out": "open('/var/tmp/nobody-escaped', 'w').write('x')",  # world-writable on the host
    "caps": "import subprocess\\nprint(subprocess.run(['unshare', '-m', 'true']).returncode)",
}
with Sandbox(workers=1, limits=SandboxLimits(wall_s=5, max_procs=8)) as sb:
    out = {k: (lambda r: [r.reason, r.stdout])(sb.run_sync(c)) for k, c in codes.items()}
    print(json.dumps({"isolation": sb.isolation, "results": out}))
"""


def test_namespaces_as_an_unprivileged_user():
    """The mode a non-root service gets (a user namespace), run here as uid 65534 with the system's
    interpreter (the venv's may sit under a folder only root can read)."""
    import json
    import shutil
    import subprocess

    system_python = "/usr/bin/python3"
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.access(system_python, os.X_OK):
        pytest.skip("needs root (to become uid 65534), setpriv and /usr/bin/python3")
    if subprocess.run([system_python, "-c", "import sys; assert sys.version_info >= (3, 11)"]).returncode:
        pytest.skip("the system's Python is older than 3.11")
    import tempfile

    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    # The package alone (stdlib only), copied where uid 65534 can read it: the checkout may sit
    # under a folder only root can enter (a CI clone in `mktemp -d`, mode 0700).
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o755)
        shutil.copytree(
            os.path.join(checkout, "common", "sandbox"),
            os.path.join(root, "common", "sandbox"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        shutil.copy(os.path.join(checkout, "common", "__init__.py"), os.path.join(root, "common"))
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                os.chmod(os.path.join(folder, name), 0o755 if name in dirs else 0o644)
        cmd = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", system_python, "-c", NOBODY_PROBE]
        done = subprocess.run([*cmd, root], capture_output=True, text=True, timeout=60)
    if done.returncode and "no sandbox worker could start" in done.stderr:
        pytest.skip(f"this host gives an unprivileged user no namespaces: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["isolation"] in ("namespaces-user", "process")
    res = out["results"]
    assert res["ok"] == ["ok", "4\n"]
    assert res["socket"][0] == "exit" and res["write_out"][0] == "exit"
    assert not os.path.exists("/var/tmp/nobody-escaped")
    if out["isolation"] == "namespaces-user":
        assert res["fork_bomb"][0] == "processes"
        assert res["caps"] == ["ok", "1\n"]  # no capability to make a mount namespace
