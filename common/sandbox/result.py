"""What a sandbox call may use (``SandboxLimits``) and what it gives back (``SandboxResult``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Why a call ended. Everything but "ok" is a failure of that call only; the sandbox goes on.
REASONS = {
    "ok": "exited with code 0",
    "exit": "exited with a non-zero code (an uncaught exception: its traceback is on stderr)",
    "timeout": "ran past its wall-time limit; killed with every process it started",
    "cpu_time": "used its CPU-time limit (SIGXCPU)",
    "memory": "raised MemoryError at its memory limit (RLIMIT_AS)",
    "processes": "could not start a process or thread at its limit (RLIMIT_NPROC: a fork bomb)",
    "output_limit": "wrote more than its output limit to stdout + stderr; killed",
    "file_size": "wrote a file past its file-size limit (SIGXFSZ)",
    "signal": "killed by a signal (a crash, or the kernel)",
    "sandbox_error": "the sandbox could not run it (no warm worker, a worker that failed its set-up)",
}


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits; every field must be > 0."""

    wall_s: float = 10.0  # wall-clock seconds from the code's arrival to its end
    cpu_s: float = 10.0  # CPU seconds (RLIMIT_CPU, whole seconds rounded up)
    memory_mb: int = 512  # address space of each process (RLIMIT_AS); the interpreter itself takes ~30
    max_procs: int = 16  # processes + threads (RLIMIT_NPROC); the interpreter is one
    max_output_bytes: int = 1 << 20  # stdout + stderr together; past it the call is killed
    file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)
    disk_mb: int = 64  # size of its work dir (a tmpfs; namespace modes only), set when a worker starts
    open_files: int = 64  # file descriptors (RLIMIT_NOFILE)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SandboxLimits.{f.name} must be a number > 0, got {v!r}")

    def replace(self, **changes) -> SandboxLimits:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(
                f"unknown sandbox limit(s) {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **changes)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when it ended by a signal or was killed
    reason: str  # a key of REASONS
    message: str  # one line for a log or a tool answer: what happened
    wall_s: float
    cpu_s: float | None = None  # CPU seconds of the code's first process (its children not counted)
    max_rss_mb: float | None = None
    truncated: bool = False  # stdout/stderr were cut at the output limit
    isolation: str = ""  # the worker's mode: namespaces-root, namespaces-user or process

    @property
    def ok(self) -> bool:
        return self.reason == "ok"
