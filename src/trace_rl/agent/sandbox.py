"""run_python: run model-written Python in a fresh, isolated, resource-limited process tree.

The code is untrusted: it may loop forever, allocate without bound, fork-bomb, print gigabytes, try to
read or write host files, open sockets, signal our process, or leave daemons behind. Each call gets a
fresh interpreter (`python -I -S`: no user site, no environment-driven paths), a fresh empty working
directory, a minimal environment (PATH, HOME, TMPDIR, LANG, single-thread BLAS), stdin at /dev/null,
and is killed with everything it started when the call returns.

Two isolation levels (`ExecResult.isolation` says which one ran):

`"bwrap"` (bubblewrap, used when it works here): new pid, network, ipc, uts and mount namespaces.
  - filesystem: an empty root with read-only binds of /usr, /lib*, /bin, /sbin and the interpreter's
    install prefix (its bundled site-packages hidden under an empty tmpfs); nothing from /etc, /home,
    /root or the project. The working directory /tmp and /dev/shm are size-capped tmpfs (`disk_mb`)
    that vanish with the call. `site_packages=True` adds the interpreter's site-packages (the venv's,
    numpy etc.) read-only.
  - network: an empty network namespace (its own loopback only).
  - processes: the namespace's init is killed at the end, which kills every process in it (daemons,
    double forks); the code cannot address any host process.
  - user: as root, bwrap runs in privileged mode and the code leaves root for a uid of its own before
    it runs (no capabilities left, `no_new_privs` set by bwrap), so RLIMIT_NPROC applies (root is
    exempt from it; bwrap's `--unshare-user --uid` maps to kernel uid 0, which stays exempt). Not
    root: bwrap creates a user namespace and RLIMIT_NPROC counts per user namespace (Linux >= 5.14).

`"rlimits"` (fallback without a working bwrap; a warning is logged once): a plain subprocess in a new
  session, with the same rlimits, environment and temporary working directory (a host directory,
  removed afterwards). As root the code runs as a uid of its own, so it cannot signal our process or
  other users' processes, cannot read or write files that "other" users cannot, and its leftovers are
  found by uid and killed. It is NOT isolated from the network, from world-readable host files, or
  from world-writable directories such as /tmp; disk use is bounded per file only (RLIMIT_FSIZE).
  Not root: the code runs as our own user and could signal our processes; daemons that leave the
  session may survive. Install bubblewrap (`apt-get install bubblewrap`) for real isolation.

Limits, in both levels: wall time `timeout_s` (then the whole tree is killed), CPU seconds
(RLIMIT_CPU, about `timeout_s` per process), address space per process `memory_mb` (RLIMIT_AS),
processes and threads `max_processes` (RLIMIT_NPROC, for a uid used by this call only when we are
root), largest file `disk_mb` (RLIMIT_FSIZE), 256 open files, no core dumps, and at most
`max_output_bytes` kept of each of stdout and stderr (pipes are read as the code writes; past the
limit the first and last halves are kept and the middle is dropped). Total memory is bounded by
`max_processes * memory_mb` plus the two tmpfs, not by `memory_mb` alone (no cgroup is used).
There is no seccomp filter: the code can make any system call an unprivileged process can.

Linux only. A uid per call is `_UID_BASE + (pid << 8 | call counter)`, in [2**30, 2**31).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

Isolation = Literal["bwrap", "rlimits"]
ISOLATIONS: tuple[Isolation, ...] = ("bwrap", "rlimits")

_MIB = 1 << 20
_MAX_OPEN_FILES = 256
_WORKDIR = "/tmp"
"""The working directory inside bwrap: a tmpfs, also what HOME and TMPDIR point to."""
_UID_BASE = 1 << 30
_NOBODY = 65534
_DRAIN_S = 2.0
"""After the tree is killed, how long to keep reading pipes that a surviving process might hold."""
_REAP_S = 10.0
"""How long to wait for the kernel to tear down a killed pid namespace before logging an error."""


@dataclass(frozen=True)
class ExecResult:
    """What one `run_python` call produced."""

    stdout: str
    stderr: str
    returncode: int | None
    """Exit status; -N when killed by signal N (e.g. -9 at the CPU limit); None when timed out."""
    timed_out: bool
    truncated: bool
    """stdout or stderr exceeded `max_output_bytes`: its first and last halves are kept, joined by a
    line "... [N bytes dropped] ..."."""
    isolation: Isolation
    """Which isolation level ran the code: "bwrap" (namespaces) or "rlimits" (fallback, weaker)."""


class SandboxUnavailable(RuntimeError):
    """No isolation level can run code on this machine (or the one asked for cannot)."""


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    max_processes: int = 16,
    disk_mb: int = 64,
    site_packages: bool = False,
    python: str | None = None,
    isolation: Literal["auto", "bwrap", "rlimits"] = "auto",
) -> ExecResult:
    """Run `code` as a Python program in a sandbox and return its output; see the module docstring.

    Never raises for anything the code does (errors, signals, limits show in the result). Raises
    ValueError for bad arguments and SandboxUnavailable when the machine cannot run a sandbox.

    `python` is the interpreter (default: this process's); `site_packages` lets the code import what
    is installed in it (read-only); `isolation="auto"` uses bwrap when it works, else the fallback.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be str, got {type(code).__name__}")
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    for name, value, least in (("memory_mb", memory_mb, 32), ("max_output_bytes", max_output_bytes, 0),
                               ("max_processes", max_processes, 1), ("disk_mb", disk_mb, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if isolation not in ("auto", *ISOLATIONS):
        raise ValueError(f"isolation must be 'auto', 'bwrap' or 'rlimits', got {isolation!r}")
    interp = _interpreter(python or sys.executable)
    level = _resolve(isolation, interp)
    limits = _Limits(timeout_s, memory_mb, max_output_bytes, max_processes, disk_mb)
    return _run(level, interp, code, limits, site_packages)


def check_sandbox(isolation: Literal["auto", "bwrap", "rlimits"] = "auto", python: str | None = None) -> Isolation:
    """The level `run_python(isolation=..., python=...)` will use here; raises SandboxUnavailable saying
    what to do when none can run. Call it before work starts: the first call makes a test run."""
    if isolation not in ("auto", *ISOLATIONS):
        raise ValueError(f"isolation must be 'auto', 'bwrap' or 'rlimits', got {isolation!r}")
    return _resolve(isolation, _interpreter(python or sys.executable))


def isolation_problem(isolation: Isolation, python: str | None = None) -> str | None:
    """Why `isolation` cannot run code with this interpreter on this machine; None when it can."""
    if _machine_problem():
        return _machine_problem()
    try:
        interp = _interpreter(python or sys.executable)
    except SandboxUnavailable as exc:
        return str(exc)
    return _bwrap_problem(interp) if isolation == "bwrap" else _rlimits_problem(interp)


# ---------------------------------------------------------------------------------------------- setup


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_mb: int
    max_output_bytes: int
    max_processes: int
    disk_mb: int


@dataclass(frozen=True)
class _Interpreter:
    """Where an interpreter's files are: what the sandbox must let it read."""

    executable: str
    """The real binary (a venv's python is a symlink to its base interpreter)."""
    roots: tuple[str, ...]
    """Directories holding the binary, its stdlib and shared library (the install prefix)."""
    stdlib: str
    site_dirs: tuple[str, ...]
    """site-packages of the interpreter as called (the venv's, in a venv): added by site_packages=True."""
    hidden_dirs: tuple[str, ...]
    """site-packages of the base install: inside bwrap they are covered by an empty tmpfs."""


_QUERY = """
import json, os, site, sys, sysconfig
base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
print(json.dumps({
    "executable": os.path.realpath(sys.executable),
    "prefixes": sorted({sys.base_prefix, sys.base_exec_prefix}),
    "stdlib": sysconfig.get_path("stdlib"),
    "site_dirs": [d for d in site.getsitepackages() if os.path.isdir(d)],
    "base_site_dirs": sorted({sysconfig.get_path(k, vars=base) for k in ("purelib", "platlib")}),
}))
"""


@functools.lru_cache(maxsize=None)
def _interpreter(python: str) -> _Interpreter:
    if not python:
        raise SandboxUnavailable("no Python interpreter to run (sys.executable is empty); pass python=")
    try:
        # Without -S: `site` is what points sys.prefix at a venv.
        out = subprocess.run([python, "-I", "-c", _QUERY], capture_output=True, text=True, timeout=60, check=True)
        info = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise SandboxUnavailable(f"cannot query the interpreter {python!r}: {exc}") from None
    executable = info["executable"]
    roots = [p for p in info["prefixes"] if not _under(p, "/usr")]
    if not any(_under(executable, r) for r in [*roots, "/usr"]):
        roots.append(os.path.dirname(executable))
    site_dirs = tuple(info["site_dirs"])
    hidden = tuple(d for d in info["base_site_dirs"] if os.path.isdir(d) and d not in site_dirs)
    return _Interpreter(executable, tuple(roots), info["stdlib"], site_dirs, hidden)


_FALLBACK_WARNED = False
_RESOLVE_LOCK = threading.Lock()


def _resolve(isolation: str, interp: _Interpreter) -> Isolation:
    global _FALLBACK_WARNED
    if _machine_problem():
        raise SandboxUnavailable(_machine_problem())
    if isolation in ISOLATIONS:
        problem = _bwrap_problem(interp) if isolation == "bwrap" else _rlimits_problem(interp)
        if problem:
            raise SandboxUnavailable(f"isolation={isolation!r} is not usable here: {problem}")
        return isolation  # type: ignore[return-value]
    bwrap_problem = _bwrap_problem(interp)
    if bwrap_problem is None:
        return "bwrap"
    rlimits_problem = _rlimits_problem(interp)
    if rlimits_problem:
        raise SandboxUnavailable(
            f"no sandbox can run model code here. bwrap: {bwrap_problem}. rlimits fallback: {rlimits_problem}"
        )
    with _RESOLVE_LOCK:
        if not _FALLBACK_WARNED:
            _FALLBACK_WARNED = True
            logger.warning(
                "python sandbox: bubblewrap is not usable (%s); falling back to isolation='rlimits': resource "
                "limits%s only, NO network or filesystem isolation. Install bubblewrap to isolate model code.",
                bwrap_problem, " and a separate uid" if os.geteuid() == 0 else "",
            )
    return "rlimits"


@functools.lru_cache(maxsize=None)
def _machine_problem() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the sandbox needs Linux"
    try:  # we wait for process exits with pidfds
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        return f"pidfd_open does not work here (needs Linux >= 5.3): {exc}"
    return None


@functools.lru_cache(maxsize=None)
def _bwrap_problem(interp: _Interpreter) -> str | None:
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (apt-get install bubblewrap, or `make` as root)"
    if os.geteuid() == 0 and _sandbox_uid() is None:
        return "no uid to run the code as"
    # A real run proves that namespaces, mounts and the privilege drop work here.
    probe = _run("bwrap", interp, "print('ok')", _Limits(30.0, 256, 4096, 4, 1), site_packages=False)
    if probe.returncode != 0 or probe.stdout != "ok\n":
        return f"a test run failed (exit status {probe.returncode}): {probe.stderr.strip()[-500:]}"
    return None


def _rlimits_problem(interp: _Interpreter) -> str | None:
    if os.geteuid() != 0:
        return None
    if _sandbox_uid() is None:
        return "no uid to run the code as"
    for path in (interp.executable, interp.stdlib):
        blocked = _blocked_for_others(path)
        if blocked:
            other = _interpreter_for_everyone()
            such_as = f", such as {other}" if other else " (none found on this machine)"
            return (f"as root the fallback runs code as an unprivileged uid, which cannot reach {path} "
                    f"({blocked} is not readable/searchable by other users). Install bubblewrap "
                    f"(apt-get install bubblewrap), or run the fallback with an interpreter every user can "
                    f"run{such_as}")
    return None


def _interpreter_for_everyone() -> str | None:
    """An installed python3 that the fallback can run as an unprivileged uid (for error messages)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")):
        if not candidate or not os.access(candidate, os.X_OK):
            continue
        try:
            interp = _interpreter(candidate)
        except SandboxUnavailable:
            continue
        if not any(_blocked_for_others(path) for path in (interp.executable, interp.stdlib)):
            return candidate
    return None


# ---------------------------------------------------------------------------------------------- run


def _run(level: Isolation, interp: _Interpreter, code: str, limits: _Limits, site_packages: bool) -> ExecResult:
    uid = _sandbox_uid() if os.geteuid() == 0 else None
    site_dirs = interp.site_dirs if site_packages else ()
    workdir = None
    try:
        if level == "bwrap":
            proc, kill_tree = _start_bwrap(interp, limits, site_dirs, uid)
        else:
            workdir = tempfile.mkdtemp(prefix="trace-rl-sandbox-")
            proc, kill_tree = _start_rlimits(interp, limits, site_dirs, uid, workdir)
        out, err, timed_out, truncated = _collect(proc, code.encode("utf-8", "surrogatepass"), limits, kill_tree)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    returncode = None if timed_out else proc.returncode
    if level == "bwrap" and returncode is not None and 128 < returncode < 128 + 65:
        returncode = 128 - returncode  # bwrap reports a signal N as exit status 128 + N
    return ExecResult(out, err, returncode, timed_out, truncated, level)


_PIPES = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}


_Started = tuple[subprocess.Popen, Callable[[], None]]
"""The running sandbox and the function that kills all of it (returns once it is all gone)."""


def _start_bwrap(interp: _Interpreter, limits: _Limits, site_dirs: tuple[str, ...], uid: int | None) -> _Started:
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    try:
        try:
            privileged = uid is not None
            argv = _bwrap_argv(interp, site_dirs, limits.disk_mb, info_fd=info_w, block_fd=block_r, privileged=privileged)
            # As root bwrap starts the code as root (privileged mode); the launcher leaves root for `uid`.
            argv += _launcher_argv(interp.executable, uid, _rlimits(limits, limits.max_processes), site_dirs)
            # A session of its own: a terminal's Ctrl-C (SIGINT to our whole process group) must not kill a
            # call the trainer finishes before it stops at the step boundary.
            proc = subprocess.Popen(argv, cwd="/", env=_environment(_WORKDIR), pass_fds=(info_w, block_r), start_new_session=True, **_PIPES)
        finally:
            os.close(info_w)
            os.close(block_r)
        try:
            kill_tree = _bwrap_killer(proc, _read_child_pid(info_r))
            os.write(block_w, b"go")  # the code starts only now: its init cannot be gone before we hold its pidfd
        except BrokenPipeError:
            pass  # bwrap failed during setup; its stderr says why
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    finally:
        os.close(info_r)
        os.close(block_w)
    return proc, kill_tree


def _start_rlimits(
    interp: _Interpreter, limits: _Limits, site_dirs: tuple[str, ...], uid: int | None, workdir: str
) -> _Started:
    drop: dict = {}
    nproc = limits.max_processes
    if uid is not None:
        for path in site_dirs:
            if _blocked_for_others(path):
                raise SandboxUnavailable(f"site_packages=True: the fallback's unprivileged uid cannot read {path} "
                                         f"({_blocked_for_others(path)} is closed to other users); install bubblewrap")
        os.chown(workdir, uid, uid)
        drop = {"user": uid, "group": uid, "extra_groups": []}  # before exec, so no root Python runs the code
    else:
        nproc += _count_tasks(os.getuid())  # our own uid: RLIMIT_NPROC counts all our processes
    argv = _launcher_argv(interp.executable, None, _rlimits(limits, nproc), site_dirs)
    proc = subprocess.Popen(argv, cwd=workdir, env=_environment(workdir), start_new_session=True, **drop, **_PIPES)
    return proc, _rlimits_killer(proc, uid, interp.executable)


def _bwrap_argv(
    interp: _Interpreter, site_dirs: tuple[str, ...], disk_mb: int, *, info_fd: int, block_fd: int, privileged: bool
) -> list[str]:
    argv = [
        "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--die-with-parent", "--new-session",
        "--info-fd", str(info_fd), "--block-fd", str(block_fd),
    ]
    if privileged:  # keep only what the launcher needs to leave root; it drops these too
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    size = str(disk_mb * _MIB)
    argv += [
        "--proc", "/proc", "--dev", "/dev",
        "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm",
        "--size", size, "--perms", "1777", "--tmpfs", _WORKDIR,
        "--ro-bind", "/usr", "/usr",
    ]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    made, bound = {"/tmp", "/dev", "/proc"}, ["/usr"]
    for path, kind in [*((r, "--ro-bind") for r in interp.roots), *((d, "--tmpfs") for d in interp.hidden_dirs),
                       *((d, "--ro-bind") for d in site_dirs)]:
        # bwrap would create missing parents with mode 0700, unreadable once the code leaves root
        for parent in _parents(path):
            if parent not in made and not any(_under(parent, b) for b in bound):
                made.add(parent)
                argv += ["--perms", "0755", "--dir", parent]
        argv += [kind, path] if kind == "--tmpfs" else [kind, path, path]
        bound.append(path)
    return argv + ["--remount-ro", "/", "--chdir", _WORKDIR]


# Runs first inside the sandbox (as `python -I -S -c`): set limits, read the code from stdin, leave
# root if asked, then run the code as __main__ with tracebacks that start at the code's own frames.
_LAUNCHER = r"""
def _start():
    import os, resource, sys
    _, uid, rlimits, *site_dirs = sys.argv
    for item in rlimits.split(","):
        name, soft, hard = item.split(":")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    source = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if uid != "-":
        os.setgroups([])
        os.setresgid(int(uid), int(uid), int(uid))
        os.setresuid(int(uid), int(uid), int(uid))
    import builtins, _sitebuiltins
    builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
    builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    if site_dirs:
        import site
        for path in site_dirs:
            site.addsitedir(path)
    sys.argv = ["-c"]
    return source

def _main(source):
    import sys
    namespace = sys.modules["__main__"].__dict__
    keep = ("__name__", "__doc__", "__builtins__", "__loader__", "__spec__", "__package__")
    for name in [n for n in namespace if n not in keep]:
        del namespace[name]
    try:
        exec(compile(source, "<code>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        import linecache, traceback
        linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")  # source lines in tracebacks
        exc.__traceback__ = exc.__traceback__.tb_next  # hide this frame
        if sys.excepthook is sys.__excepthook__:
            traceback.print_exception(exc)  # the C hook reads source from files, not linecache
        else:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)

_main(_start())
"""


def _launcher_argv(
    executable: str, uid: int | None, rlimits: list[tuple[str, int, int]], site_dirs: tuple[str, ...]
) -> list[str]:
    spec = ",".join(f"{name}:{soft}:{hard}" for name, soft, hard in rlimits)
    # -u: output written before a kill is not lost in a buffer; -B: no .pyc writes
    flags = ["-I", "-S", "-B", "-u", "-X", "utf8"]
    return [executable, *flags, "-c", _LAUNCHER, "-" if uid is None else str(uid), spec, *site_dirs]


def _rlimits(limits: _Limits, nproc: int) -> list[tuple[str, int, int]]:
    cpu = math.ceil(limits.timeout_s) + 1  # SIGXCPU at `cpu` seconds, SIGKILL one second later
    return [
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", limits.memory_mb * _MIB, limits.memory_mb * _MIB),
        ("RLIMIT_FSIZE", limits.disk_mb * _MIB, limits.disk_mb * _MIB),
        ("RLIMIT_NPROC", nproc, nproc),
        ("RLIMIT_NOFILE", _MAX_OPEN_FILES, _MAX_OPEN_FILES),
        ("RLIMIT_CORE", 0, 0),
    ]


def _environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        # BLAS/OpenMP start one thread per core by default; threads count against max_processes
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


# ---------------------------------------------------------------------------------------------- I/O


class _Capture:
    """Keeps the first and the last `limit // 2` bytes of a stream (a traceback ends it); drops the middle."""

    def __init__(self, limit: int) -> None:
        self.head_limit, self.tail_limit = limit - limit // 2, limit // 2
        self.head, self.tail = bytearray(), bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_limit:
            self.tail += chunk[-self.tail_limit :]
            if len(self.tail) > 2 * self.tail_limit:  # trim now and then, so memory stays bounded
                del self.tail[: -self.tail_limit]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_limit + self.tail_limit

    def text(self) -> str:
        tail = self.tail[-self.tail_limit :] if self.tail_limit else b""
        if not self.truncated:
            return (self.head + tail).decode("utf-8", "replace")
        dropped = self.total - len(self.head) - len(tail)
        head, tail_text = self.head.decode("utf-8", "replace"), tail.decode("utf-8", "replace")
        return f"{head}\n... [{dropped} bytes dropped] ...\n{tail_text}"


def _collect(
    proc: subprocess.Popen, stdin_data: bytes, limits: _Limits, kill_tree: Callable[[], None]
) -> tuple[str, str, bool, bool]:
    """Feed stdin and read both pipes until the code exits or times out; kill the tree either way."""
    out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
    main_exit = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    sel.register(main_exit, selectors.EVENT_READ, "exit")
    sel.register(proc.stdout, selectors.EVENT_READ, out)  # type: ignore[arg-type]
    sel.register(proc.stderr, selectors.EVENT_READ, err)  # type: ignore[arg-type]
    stdin_fd = proc.stdin.fileno()  # type: ignore[union-attr]
    os.set_blocking(stdin_fd, False)
    sel.register(stdin_fd, selectors.EVENT_WRITE, "stdin")
    pending = memoryview(stdin_data)
    deadline = time.monotonic() + limits.timeout_s
    timed_out = ended = False
    drain_until = 0.0
    try:
        while True:
            now = time.monotonic()
            if not ended and now >= deadline:
                timed_out = ended = True
                kill_tree()
                drain_until = time.monotonic() + _DRAIN_S
            streams = [k for k in sel.get_map().values() if isinstance(k.data, _Capture)]
            if ended and (not streams or time.monotonic() >= drain_until):
                break
            for key, _ in sel.select((drain_until if ended else deadline) - time.monotonic()):
                if key.data == "exit":
                    sel.unregister(main_exit)
                    if not ended:
                        ended = True
                        kill_tree()  # daemons and other leftovers die with the main process
                        drain_until = time.monotonic() + _DRAIN_S
                elif key.data == "stdin":
                    try:
                        pending = pending[os.write(stdin_fd, pending[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the code died before reading all of itself
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(stdin_fd)
                        proc.stdin.close()  # type: ignore[union-attr]
                else:
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        key.data.feed(chunk)
                    else:
                        sel.unregister(key.fileobj)
    finally:
        if not ended:  # our own error (or KeyboardInterrupt): never leave the tree running
            kill_tree()
        sel.close()
        os.close(main_exit)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass
        proc.wait()
    return out.text(), err.text(), timed_out, out.truncated or err.truncated


# ---------------------------------------------------------------------------------------------- killing


def _read_child_pid(info_fd: int) -> int | None:
    """bwrap writes {"child-pid": N, ...} (N: the namespace's init, as a host pid) and closes the fd."""
    data = b""
    while chunk := os.read(info_fd, 4096):
        data += chunk
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None  # bwrap failed before creating the namespace; its stderr says why


def _bwrap_killer(proc: subprocess.Popen, init_pid: int | None) -> Callable[[], None]:
    # Killing the namespace's init makes the kernel kill every process in the namespace; init's pidfd
    # turns readable only after they are all gone. Opened now, while bwrap (its parent) still holds it.
    init_fd = None
    if init_pid is not None:
        try:
            init_fd = os.pidfd_open(init_pid)
        except ProcessLookupError:
            pass
        if init_fd is not None and _parent_pid(init_pid) != proc.pid:  # not bwrap's child: never signal it
            os.close(init_fd)
            init_fd = None

    def kill_tree() -> None:
        nonlocal init_fd
        if init_fd is not None:
            try:
                signal.pidfd_send_signal(init_fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if not _wait_readable(init_fd, _REAP_S):
                logger.error("python sandbox: pid namespace of init %s still alive after %ss", init_pid, _REAP_S)
            os.close(init_fd)
            init_fd = None
        proc.kill()

    return kill_tree


def _rlimits_killer(proc: subprocess.Popen, uid: int | None, executable: str) -> Callable[[], None]:
    def kill_tree() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session the code started in (pgid == its pid)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None:
            _kill_uid(uid, executable)
        proc.kill()

    return kill_tree


def _kill_uid(uid: int, executable: str) -> None:
    """Kill every process running as `uid` (used by this call only), including ones that left the session.

    kill(-1) sent *as* that uid reaches all of them at once, so a fork bomb cannot outrun it; it is
    sent from a helper process because kill(-1) from root would hit the whole machine.
    """
    for _ in range(5):
        if not _pids_of_uid(uid):
            return
        subprocess.run(
            [executable, "-I", "-S", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)"],
            user=uid, group=uid, extra_groups=[], env={}, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, check=False,
        )
        time.sleep(0.01)
    if _pids_of_uid(uid):
        logger.error("python sandbox: processes of uid %s survived kill(-1): %s", uid, _pids_of_uid(uid))


def _wait_readable(fd: int, timeout_s: float) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout_s))


# ---------------------------------------------------------------------------------------------- /proc, uids, paths


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
    except (OSError, IndexError, ValueError):
        return None


def _pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real, effective or saved uid is `uid`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        if fields.get(b"State", b"").strip().startswith(b"Z"):
            continue
        if str(uid).encode() in fields.get(b"Uid", b"").split()[:3]:
            pids.append(int(name))
    return pids


def _count_tasks(uid: int) -> int:
    """Processes and threads of `uid` now: what RLIMIT_NPROC compares against."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                continue
    return count


_CALLS = itertools.count()


def _sandbox_uid() -> int | None:
    """A uid no other live call uses, so RLIMIT_NPROC and kill(-1) cover this call's processes only.

    Falls back to nobody (65534, shared by concurrent calls) when our user namespace does not map
    the range; None when neither is mapped.
    """
    if _uid_range_mapped(_UID_BASE, 1 << 30):
        return _UID_BASE + (((os.getpid() & 0x3FFFFF) << 8) | (next(_CALLS) & 0xFF))
    return _NOBODY if _uid_range_mapped(_NOBODY, 1) else None


@functools.lru_cache(maxsize=None)
def _uid_range_mapped(first: int, count: int) -> bool:
    for name in ("uid_map", "gid_map"):
        try:
            with open(f"/proc/self/{name}") as f:
                extents = [tuple(map(int, line.split())) for line in f if line.strip()]
        except OSError:
            return False
        if not any(inside <= first and first + count <= inside + length for inside, _, length in extents):
            return False
    return True


def _blocked_for_others(path: str) -> str | None:
    """The first component of `path` that a user other than its owner cannot search or read, if any."""
    parts = [p for p in _parents(path)] + [path]
    for i, part in enumerate(parts):
        try:
            mode = os.stat(part).st_mode
        except OSError:
            return part
        needed = stat.S_IXOTH if (i < len(parts) - 1 or stat.S_ISDIR(mode)) else stat.S_IROTH
        if not mode & needed:
            return part
    return None


def _parents(path: str) -> list[str]:
    """'/a/b/c' -> ['/a', '/a/b'] (without '/' and the path itself)."""
    parts = os.path.normpath(path).strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _under(path: str, root: str) -> bool:
    return os.path.normpath(path) == root or os.path.normpath(path).startswith(root.rstrip("/") + "/")
