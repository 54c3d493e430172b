"""The sandbox's child: a warm Python interpreter that isolates itself, then runs one piece of code.

Started once per ``Sandbox`` by ``common/sandbox/pool.py`` as a **fork server**: ``python -I -S
runner.py --ctl FD CONFIG_JSON``, by path (standard library only; ``-S``: the interpreter's
site-packages are put on ``sys.path`` from CONFIG without running their ``.pth`` files). It loads
this file once, then forks one worker per request (``serve``), so a worker costs a fork, not an
interpreter start. A worker does the costly part before any code exists -- namespaces, the new
root, dropping privileges -- then waits on its control socket; a call costs one message. One
worker runs one call and exits: nothing a call leaves behind (files, processes, modules, globals)
reaches the next.

Three processes, as container runtimes have:
- **W** (forked by the fork server, its own session) unshares the namespaces, forks C, says C's
  pid and waits for it;
- **C** is PID 1 of a new PID namespace: it builds and enters the new root, drops privileges, forks
  D, and reports how D ended (exit code or signal, CPU seconds, peak memory) on the control socket.
  Killing C kills every process the code started (the kernel empties a PID namespace whose init
  dies);
- **D** says it is ready, reads the request, closes the control socket (user code never sees it),
  sets the per-call resource limits and runs the code as ``__main__``. Not C itself: the kernel
  does not deliver the signals of RLIMIT_CPU (SIGXCPU) to a namespace's init.

Isolation modes (``CONFIG["mode"]``; ``auto`` tries them in this order):
- ``namespaces-root`` (run as root): new mount, network, PID, IPC and UTS namespaces; the code
  runs as an unprivileged uid of its own (so RLIMIT_NPROC counts only its processes);
- ``namespaces-user`` (not root, unprivileged user namespaces allowed): the same namespaces in a
  new user namespace; capabilities cleared after set-up (the uid stays the caller's, mapped to 0);
- ``process``: no namespaces. Resource limits, the uid drop when root, and a Python audit hook
  that refuses sockets, subprocesses, ctypes and file access outside the work dir and the
  interpreter's own files. Audit hooks are not a security boundary (docs/environments.md).

Fork-server socket (SOCK_SEQPACKET, one JSON message each): pool -> server ``{"uid", "workdir"}``
with four fds (the worker's stdin, stdout, stderr and control socket); server -> pool ``{"pid": W}``.
Worker control socket protocol (one JSON object per line):
W -> parent ``{"child": PID of C}``; D -> parent ``{"ready": MODE}`` (or C: ``{"error": "why"}``);
parent -> D ``{"code": ..., "cpu_s": ..., "memory_mb": ..., "max_procs": ..., "file_mb": ...,
"open_files": ...}``; C -> parent ``{"exit": N}`` or ``{"signal": N}`` with ``"cpu_s"`` and ``"rss_mb"``.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import socket
import sys
import traceback
import types

RC_PROCS = 248  # the code's fork / thread start failed with EAGAIN (RLIMIT_NPROC)
RC_MEMORY = 249  # the code raised MemoryError (RLIMIT_AS); its traceback is on stderr
RC_SETUP = 250  # C could not isolate itself; the reason went to the control socket

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 28, 38
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED = 1, 2
# syscalls the libc has no wrapper for (or Python does not expose): pivot_root, capset
SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}

# the libc already loaded into this interpreter (ctypes.util.find_library would run ldconfig: 10 ms)
_libc = ctypes.CDLL(None, use_errno=True)


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    _ok(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {src or fstype} on {target}")


def _syscall(name: str, *args) -> int:
    machine = os.uname().machine
    nr = SYSCALLS.get(machine, {}).get(name)
    if nr is None:
        raise OSError(f"{name}: syscall number unknown on {machine}")
    return _libc.syscall(nr, *args)


def _prctl(option: int, arg: int) -> None:
    _ok(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def _send(sock: socket.socket, **msg) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _recv_line(sock: socket.socket) -> dict:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise EOFError("control socket closed")
        buf += chunk
    return json.loads(buf)


# ---------------------------------------------------------------- W: namespaces, fork, report


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def unshare(mode: str) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if mode == "namespaces-user":
        uid, gid = os.getuid(), os.getgid()
        _ok(_libc.unshare(flags | CLONE_NEWUSER), "unshare (user namespace)")
        _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
    else:
        _ok(_libc.unshare(flags), "unshare")


def _quiet() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the parent's EOF on the code's output must not wait for this process
        os.dup2(devnull, fd)


def watch(sock: socket.socket, child: int) -> None:
    """W's part after the fork: say C's pid, wait for C, exit."""
    _quiet()
    _send(sock, child=child)
    sock.close()
    while True:
        try:
            os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    os._exit(0)


def report(sock: socket.socket, child: int) -> None:
    """C's part after forking D: wait for D and say how it ended. (C is PID 1 of its namespace, and
    the kernel does not deliver SIGXCPU and the like to a namespace's init: so the code runs in D.)"""
    _quiet()
    while True:
        try:
            _, status, usage = os.wait4(child, 0)
            break
        except InterruptedError:
            continue
    end = {"cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024}
    if os.WIFSIGNALED(status):
        end["signal"] = os.WTERMSIG(status)
    else:
        end["exit"] = os.WEXITSTATUS(status)
    try:
        _send(sock, **end)
    except OSError:
        pass  # the parent gave up on this call (killed it); nobody to tell
    os._exit(0)


# ---------------------------------------------------------------- C: the new root


def _bind_flags(path: str) -> int:
    """Flags a read-only remount of a bind of ``path`` must carry: the original mount's locked
    flags (nosuid, nodev, noexec, atime; dropping one is refused inside a user namespace)."""
    f = os.statvfs(path).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
    if not path.startswith("/dev/"):
        flags |= MS_NODEV
    for st_bit, ms_bit in (
        (4, MS_NODEV),
        (8, MS_NOEXEC),
        (1024, MS_NOATIME),
        (2048, MS_NODIRATIME),
        (4096, MS_RELATIME),
    ):
        if f & st_bit:
            flags |= ms_bit
    return flags


def _bind_ro(src: str, root: str) -> None:
    dst = root + src
    if os.path.islink(src):  # /bin -> usr/bin: the same link, its target is bound on its own
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.lexists(dst):
            os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, MS_BIND | MS_REC)
    _mount(None, dst, None, _bind_flags(src))


def build_root(cfg: dict, uid: int | None) -> None:
    """Enter a new root holding only read-only binds of the interpreter, the system's libraries,
    a few device nodes, a fresh /proc and a writable tmpfs at /tmp (the work dir)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")  # the new root's home
    root = "/tmp/root"
    os.mkdir(root, 0o755)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for src in cfg["ro_paths"]:
        if os.path.lexists(src):
            _bind_ro(src, root)
    os.mkdir(root + "/dev", 0o755)
    for dev in ("null", "zero", "random", "urandom"):
        _bind_ro("/dev/" + dev, root)  # read-only mount; writes to /dev/null still work (a device)
    os.mkdir(root + "/proc", 0o555)
    os.mkdir(root + "/tmp", 0o700)
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=0700")
    if uid is not None:
        os.chown(root + "/tmp", uid, uid)
    os.mkdir(root + "/.old", 0o700)
    if _syscall("pivot_root", (root).encode(), (root + "/.old").encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    os.chdir("/")
    _ok(_libc.umount2(b"/.old", MNT_DETACH), "umount the old root")
    os.rmdir("/.old")
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:  # a user namespace in a container whose /proc has masked parts may not: no /proc then
        pass
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    socket.sethostname("sandbox")


def drop_privileges(uid: int | None) -> None:
    if uid is not None:  # root: become a uid of our own (clears every capability)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif os.geteuid() == 0:  # root inside a user namespace: keep the uid, lose the capabilities
        # and never regain them: uid 0 gets no capabilities from an execve (SECBIT_NOROOT, locked)
        _prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED)
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2): all empty
        if _syscall("capset", header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset: could not clear capabilities")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which resets it


# ---------------------------------------------------------------- C: process mode's guard


def install_guard(workdir: str, read_ok: list[str], no_fork: bool) -> None:
    """``process`` mode: an audit hook refusing the network, new programs, ctypes, and file access
    outside ``workdir`` (reads also in ``read_ok``); with ``no_fork`` (root: RLIMIT_NPROC does not
    bind it) forks too. Best effort: see the module docstring."""
    work = os.path.realpath(workdir)
    readable = [os.path.realpath(p) for p in read_ok] + [work, "/dev/null", "/dev/urandom", "/proc/self"]
    denied_prefixes: tuple[str, ...] = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "ctypes.")
    denied_prefixes += ("os.kill", "signal.pthread_kill")  # other processes of its uid: maybe the service's
    if no_fork:
        denied_prefixes += ("os.fork",)
    path_events = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link"}
    path_events |= {"os.rename", "os.truncate", "os.utime", "os.listdir", "os.scandir", "os.chdir", "shutil.rmtree"}
    realpath, fspath, under = os.path.realpath, os.fspath, _under

    def allowed(path, write: bool) -> bool:
        if isinstance(path, int):
            return True  # an fd it already holds
        try:
            p = realpath(fspath(path))
        except (TypeError, ValueError):
            return False
        p = p if isinstance(p, str) else p.decode(errors="replace")
        if write:
            return under(p, [work, "/dev/null"])
        return under(p, readable)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(denied_prefixes) or event == "os.system":
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & 0o103)
            if path is not None and not allowed(path, write):
                raise PermissionError(f"sandbox: open {path!r} is outside the sandbox")
        elif event in path_events:
            write = event not in ("os.listdir", "os.scandir", "os.chdir")
            for a in args[:2] if event in ("os.rename", "os.link", "os.symlink") else args[:1]:
                if a is not None and not allowed(a, write):
                    raise PermissionError(f"sandbox: {event} {a!r} is outside the sandbox")

    sys.addaudithook(hook)


def _others_can_read(path: str) -> bool:
    """Whether a uid of nobody's can reach ``path`` (o+x on every folder above, o+r on it)."""
    path = os.path.realpath(path)
    parts = path.split("/")
    for i in range(2, len(parts) + 1):
        mode = os.stat("/".join(parts[:i]) or "/").st_mode
        if not mode & 0o001 or (i == len(parts) and not mode & 0o004):
            return False
    return True


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _user_tasks(uid: int) -> int:
    """Tasks (threads) of ``uid`` now: RLIMIT_NPROC counts them per user."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                st = os.stat(f"/proc/{pid}")
                if st.st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return n


# ---------------------------------------------------------------- D: one call


def _print_traceback(e: BaseException) -> None:
    tb = e.__traceback__.tb_next if e.__traceback__ else None  # from the code's frame on, not this file's
    traceback.print_exception(type(e), e, tb)


def run_call(req: dict, mode: str) -> None:
    mb = 1 << 20
    cpu = max(1, int(-(-req["cpu_s"] // 1)))  # whole seconds, rounded up
    limits = [
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        (resource.RLIMIT_AS, req["memory_mb"] * mb, req["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, req["file_mb"] * mb, req["file_mb"] * mb),
        (resource.RLIMIT_NOFILE, req["open_files"], req["open_files"]),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    procs = req["max_procs"] + 1  # C, waiting for this process, runs as the same uid
    if mode == "process" and os.getuid() != 0 and not req.get("own_uid"):
        procs += _user_tasks(os.getuid())  # shares the count with the caller's processes: racy
    limits.append((resource.RLIMIT_NPROC, procs, procs))
    for what, soft, hard in limits:
        resource.setrlimit(what, (soft, hard))
    code = req["code"]
    sys.argv = ["<sandbox>"]
    import linecache  # loaded with traceback already; the code's lines in its tracebacks

    linecache.cache["<sandbox>"] = (len(code), None, code.splitlines(True), "<sandbox>")
    main = types.ModuleType("__main__")  # its own __main__, not this file (dataclasses, pickle look it up)
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    rc = 0
    try:
        exec(compile(code, "<sandbox>", "exec"), main.__dict__)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except MemoryError:
        rc = RC_MEMORY
        print("MemoryError: the sandbox's memory limit was reached", file=sys.stderr)
    except (BlockingIOError, RuntimeError) as e:  # os.fork: EAGAIN; threading: "can't start new thread"
        _print_traceback(e)
        procs = getattr(e, "errno", None) == 11 or "can't start new thread" in str(e)
        rc = RC_PROCS if procs else 1
    except BaseException as e:  # noqa: BLE001 - the code's own failure: its traceback, exit 1, as python would
        _print_traceback(e)
        rc = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # the parent stopped reading (output limit)
    os._exit(rc & 0xFF)


def child(sock: socket.socket, cfg: dict, mode: str) -> None:
    uid = cfg.get("uid") if os.geteuid() == 0 and mode != "namespaces-user" else None
    if mode == "process" and uid is not None and not all(_others_can_read(p) for p in (sys.prefix, sys.base_prefix)):
        uid = None  # another uid could not import the standard library (e.g. under /root): stay root
    try:
        if mode != "process":
            build_root(cfg, uid)
            workdir = "/tmp"
        else:
            workdir = cfg["workdir"]
            if uid is not None:
                os.chown(workdir, uid, uid)
        os.chdir(workdir)
        drop_privileges(uid)
    except Exception as e:  # noqa: BLE001 - any set-up failure is reported, then this worker is gone
        _send(sock, error=f"sandbox set-up ({mode}) failed: {type(e).__name__}: {e}")
        os._exit(RC_SETUP)
    os.environ.clear()
    os.environ.update(HOME=workdir, TMPDIR=workdir, PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8")
    pid = os.fork()
    if pid:
        report(sock, pid)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a fork clears it
    _send(sock, ready=mode)
    try:
        req = _recv_line(sock)
    except (EOFError, OSError, ValueError):
        os._exit(0)  # the pool closed (or discarded) this warm worker
    sock.close()
    if mode == "process":
        install_guard(workdir, cfg["ro_paths"], no_fork=os.geteuid() == 0)
    req["own_uid"] = uid is not None
    run_call(req, mode)


def start(sock: socket.socket, cfg: dict) -> None:
    """W: isolate (unshare), fork C, watch it. Never returns."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the fork server (and so the service) died: so do we
        modes = ["namespaces-root" if os.geteuid() == 0 else "namespaces-user", "process"]
        if cfg["mode"] != "auto":
            modes = [cfg["mode"]]
        errors = []
        for mode in modes:
            if mode == "process":
                break
            try:
                unshare(mode)
                break
            except OSError as e:
                errors.append(f"{mode}: {e}")
        else:
            _send(sock, error="no isolation available: " + "; ".join(errors))
            os._exit(RC_SETUP)
        pid = os.fork()
        if pid:
            watch(sock, pid)
        child(sock, cfg, mode)
    except BaseException as e:  # noqa: BLE001 - a forked worker must never return into the fork server's loop
        try:
            _send(sock, error=f"sandbox worker failed: {type(e).__name__}: {e}")
        finally:
            os._exit(RC_SETUP)
    os._exit(RC_SETUP)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(server: socket.socket, base: dict) -> None:
    """The fork server: each message (JSON + 4 fds: stdin, stdout, stderr, control) forks a worker W
    that starts from this interpreter, already loaded; answers ``{"pid": W}``. Its parent's end
    closing ends it. Forked workers are reaped here (they are this process's children)."""
    _send(server, zygote=os.getpid())
    while True:
        _reap()
        try:
            msg, fds, _, _ = socket.recv_fds(server, 1 << 16, 4)
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)  # the pool closed its end
        cfg = base | json.loads(msg)
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            server.sendall(json.dumps({"error": f"expected 4 fds, got {len(fds)}"}).encode())
            continue
        pid = os.fork()
        if pid == 0:
            server.close()
            os.setsid()  # its own process group: killed whole
            for target, fd in zip((0, 1, 2), fds[:3], strict=True):
                os.dup2(fd, target)
                os.close(fd)
            start(socket.socket(fileno=fds[3]), cfg)
        for fd in fds:
            os.close(fd)
        server.sendall(json.dumps({"pid": pid}).encode())


def main() -> None:
    fd = int(sys.argv[sys.argv.index("--ctl") + 1])
    base = json.loads(sys.argv[-1])
    sys.path.extend(base.get("site_paths", []))  # run with -S: packages importable, no .pth processing
    server = socket.socket(fileno=fd)
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the service died: so do we
    except OSError:
        pass
    serve(server, base)


if __name__ == "__main__":
    main()
