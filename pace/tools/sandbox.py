"""Run untrusted Python (a model's tool call) in a sandbox and return what it printed.

Backend `bwrap` (Debian's bubblewrap, installed by scripts/setup.sh), one fresh sandbox per call:
    namespaces   --unshare-all: no network (only a loopback-less net namespace), own PIDs, IPC, UTS
    file system  /usr and the interpreter's install bound read-only, a private tmpfs /tmp (the only
                 writable place), the root remounted read-only; nothing else of the host (no home
                 directories, no /etc, no run directories) is visible
    limits       set by util-linux `prlimit` before bubblewrap starts: CPU seconds, address space,
                 file size, open files; process count by RLIMIT_NPROC (a non-root host user) or, as
                 root (exempt from NPROC), by a pids cgroup when one is writable (the sandbox joins
                 it through `sh` before anything else runs)
    wall clock   the sandbox's process group is killed at the deadline (--die-with-parent and the PID
                 namespace take every process it started with it)
    output       stdout and stderr, merged, read up to `output_bytes`; a program that keeps writing
                 past the cap is killed
Backend `process` (opt-in, `tools.sandbox=process`, for machines without bubblewrap): the same
limits on a bare child process, without namespaces: no file-system or network isolation.

The sandbox is started without a `preexec_fn`, so Python spawns it with vfork: a fork of the
training process (GBs of memory, several busy threads) would copy its page tables and make every
page it writes afterwards fault once, per call; measured on the tiny tool run, that cost the
trainer 5-10x its speed.

Every failure becomes a short message the model sees as the tool's output, e.g.
"TimeoutError: wall-clock limit of 10 s exceeded"; the run never hangs or crashes on tool code.
`warm` > 0 keeps that many sandboxes started and waiting for their program on stdin (each runs
one program, then is replaced), which hides the start-up cost.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

# The program arrives on stdin, so a warm sandbox can start before its code is known.
_RUNNER = ("import sys\n"
           "src = sys.stdin.read()\n"
           "exec(compile(src, '<tool>', 'exec'), {'__name__': '__main__'})\n")
BACKENDS = ("bwrap", "process")


class SandboxUnavailable(RuntimeError):
    """The configured backend cannot run here; the message says what to do."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # whole call, start to last byte
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)
    procs: int = 32  # processes/threads
    output_bytes: int = 4096  # stdout + stderr kept


@dataclass
class ToolResult:
    output: str  # what the model sees (truncated output, or the error message)
    status: str  # ok | error (non-zero exit) | timeout | killed (signal: CPU or memory limit) | truncated
    exit_code: int | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "truncated")


def _pids_cgroup_root() -> Path | None:
    """A writable pids cgroup (v2 unified, or v1 `pids`) to cap a root-run sandbox's processes."""
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            if root.name == "pids" or "pids" in (root / "cgroup.subtree_control").read_text(errors="ignore"):
                return root
    return None


class Sandbox:
    def __init__(self, backend: str = "bwrap", limits: Limits | None = None, warm: int = 0,
                 python: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"tools.sandbox={backend!r} is not one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.limits = limits or Limits()
        self.python = python or sys.executable
        self.root = os.geteuid() == 0
        self._cgroups = _pids_cgroup_root() if self.root else None
        if shutil.which("prlimit") is None:
            raise SandboxUnavailable("the tool sandbox sets its limits with util-linux `prlimit`, which is not on PATH")
        if backend == "bwrap" and shutil.which("bwrap") is None:
            raise SandboxUnavailable("tools.sandbox=bwrap needs bubblewrap (`apt-get install bubblewrap`, which "
                                     "scripts/setup.sh does); tools.sandbox=process runs tool code without isolation")
        self._warm: deque = deque()
        self._lock = threading.Lock()
        self.warm = warm
        self._need = threading.Event()
        self._closed = False
        if warm > 0:
            # One long-lived thread starts the warm sandboxes: bubblewrap's --die-with-parent kills a
            # sandbox when the *thread* that started it exits, so a short-lived thread cannot.
            self._filler = threading.Thread(target=self._fill_loop, name="sandbox-warm", daemon=True)
            self._filler.start()
            self._need.set()

    # --- the command ----------------------------------------------------------------------
    def _command(self, cgroup: Path | None = None) -> list[str]:
        lim, mb = self.limits, 1 << 20
        limits = ["prlimit", f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_mb * mb}",
                  f"--fsize={lim.file_mb * mb}", "--nofile=256", "--core=0"]
        if not self.root:  # root is exempt from RLIMIT_NPROC; the cgroup counts its processes
            limits.append(f"--nproc={lim.procs}")
        limits.append("--")
        if cgroup is not None:
            limits = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *limits]
        runner = [self.python, "-I", "-c", _RUNNER]
        if self.python == sys.executable:
            # -S: no `site` (its .pth files cost ~50 ms of start-up per call here); the installed
            # packages (numpy, sympy, ...) stay importable from the site-packages directories
            import site

            paths = [p for p in site.getsitepackages() if Path(p).is_dir()]
            runner = [self.python, "-I", "-S", "-c", f"import sys\nsys.path.extend({paths!r})\n" + _RUNNER]
        if self.backend == "process":
            return limits + runner
        prefix = {sys.base_prefix, sys.prefix, str(Path(self.python).resolve().parents[1])}
        cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
               "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            target = Path("/") / link
            if target.is_symlink():
                cmd += ["--symlink", os.readlink(target), f"/{link}"]
            elif target.is_dir():
                cmd += ["--ro-bind", str(target), f"/{link}"]
        for p in sorted(prefix):
            if not p.startswith("/usr"):
                cmd += ["--ro-bind", p, p]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "OPENBLAS_NUM_THREADS", "1"]
        return limits + cmd + runner

    def _start(self):
        cgroup = None
        if self._cgroups is not None:
            cgroup = self._cgroups / f"pace-sandbox-{uuid.uuid4().hex[:12]}"
            try:
                cgroup.mkdir()
                (cgroup / "pids.max").write_text(str(self.limits.procs))
            except OSError:
                cgroup = None
        # no preexec_fn: spawned with vfork (see the module docstring); its own session and process group
        proc = subprocess.Popen(self._command(cgroup), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        return proc, cgroup

    def _fill_loop(self) -> None:
        while not self._closed:
            self._need.wait()
            self._need.clear()
            while not self._closed and len(self._warm) < self.warm:
                started = self._start()
                with self._lock:
                    if self._closed:
                        self._discard(started)
                        return
                    self._warm.append(started)

    # --- one call ---------------------------------------------------------------------------
    def run(self, code: str) -> ToolResult:
        """Run ``code``; never raises for anything the code does."""
        with self._lock:
            started = self._warm.popleft() if self._warm else None
        t0 = time.monotonic()
        proc, cgroup = started or self._start()
        if self.warm:
            self._need.set()
        try:
            return self._communicate(proc, code, t0)
        finally:
            if proc.returncode is None:  # not reaped yet: its pid (= group id) cannot have been reused
                _kill_group(proc)
                proc.wait()
            if cgroup is not None:
                _remove_cgroup(cgroup)

    def _communicate(self, proc, code: str, t0: float) -> ToolResult:
        lim = self.limits
        chunks: list[bytes] = []
        size = [0]
        over = threading.Event()

        def read() -> None:
            while True:
                data = proc.stdout.read1(65536)
                if not data:
                    return
                keep = max(0, lim.output_bytes - size[0])
                chunks.append(data[:keep])
                size[0] += len(data)
                if size[0] > lim.output_bytes:
                    over.set()
                    _kill_group(proc)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # it died before reading its program: reported from its exit status
        if not _exited(proc, deadline=t0 + lim.wall_s):
            _kill_group(proc)
            proc.wait()
            reader.join(1.0)
            return ToolResult(_text(chunks) + f"\nTimeoutError: wall-clock limit of {lim.wall_s:g} s exceeded",
                              "timeout", None, time.monotonic() - t0)
        _kill_group(proc)  # whatever it left running (the leader is a zombie: its group id is still its own)
        proc.wait()
        reader.join(1.0)
        seconds = time.monotonic() - t0
        text, rc = _text(chunks), proc.returncode
        if over.is_set():
            return ToolResult(text + f"\n[output truncated at {lim.output_bytes} bytes; the program was stopped]",
                              "truncated", rc, seconds)
        if rc is not None and rc < 0 or rc in (128 + signal.SIGKILL, 128 + signal.SIGXCPU):
            sig = -rc if rc < 0 else rc - 128
            why = {signal.SIGXCPU: f"CPU-time limit of {lim.cpu_s} s exceeded",
                   signal.SIGKILL: f"killed (CPU-time limit of {lim.cpu_s} s or memory limit of {lim.memory_mb} MB)"}
            return ToolResult(text + f"\nResourceError: {why.get(sig, signal.Signals(sig).name)}", "killed", rc, seconds)
        return ToolResult(text, "ok" if rc == 0 else "error", rc, seconds)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._warm:
                self._discard(self._warm.popleft())
        self._need.set()

    @staticmethod
    def _discard(started) -> None:
        proc, cgroup = started
        _kill_group(proc)
        proc.wait()
        if cgroup is not None:
            _remove_cgroup(cgroup)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _text(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", "replace")


def _exited(proc, deadline: float) -> bool:
    """Wait until ``proc`` exits or the deadline passes, without reaping it (WNOWAIT), so its pid,
    which is also its process-group id, stays reserved until the group has been killed.

    Blocks on a pidfd (readable at exit) where the kernel has them, so waiting calls do not wake
    up: a polling loop in each of `tools.workers` threads took the GIL hundreds of times a second
    from the trainer and the rollout thread (measured: training steps 5-10x slower).
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        import select

        try:  # poll, not select: a process with a thousand files open gets pidfds past select's 1024
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))
        finally:
            os.close(fd)
    delay = 0.002
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_cgroup(cgroup: Path) -> None:
    for _ in range(50):  # the kernel empties it once the killed processes are reaped
        try:
            cgroup.rmdir()
            return
        except OSError:
            time.sleep(0.01)
