"""The sandbox battery: every attack must fail AND leave the host as it was.

Each test runs once per isolation level ("bwrap", and the "rlimits" fallback). Attacks the fallback
cannot stop by design (network, world-readable or world-writable host paths; anything needing a uid
of its own when we are not root) are skipped for it, with the reason. Leftover processes are found
by a unique marker that the attack code puts in its processes' command lines.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from trace_rl.agent import sandbox
from trace_rl.agent.sandbox import (
    ISOLATIONS,
    ExecResult,
    SandboxUnavailable,
    isolation_problem,
    run_python,
)

pytestmark = pytest.mark.timeout(60)

ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[1]
SLACK_S = 1.5
"""How much longer than timeout_s a call may take (start-up, killing, tearing the namespace down)."""


@dataclass(frozen=True)
class Sandbox:
    isolation: str
    python: str | None

    def run(self, code: str, **kwargs) -> ExecResult:
        result = run_python(code, isolation=self.isolation, python=self.python, **kwargs)  # type: ignore[arg-type]
        assert result.isolation == self.isolation
        return result


def _sandbox(isolation: str) -> Sandbox:
    problem = isolation_problem(isolation)  # type: ignore[arg-type]
    if problem is None:
        return Sandbox(isolation, None)
    if isolation == "bwrap" and shutil.which("bwrap"):  # installed but broken: the tool would silently degrade
        pytest.fail(f"bwrap is installed but cannot run the sandbox: {problem}")
    # As root the fallback needs an interpreter other users can run; ours may live under /root.
    other = shutil.which("python3", path="/usr/bin:/bin")
    if isolation == "rlimits" and other and isolation_problem("rlimits", other) is None:
        return Sandbox(isolation, other)
    if isolation == "bwrap" and os.environ.get("TRACE_RL_SANDBOX_TESTS") == "require":
        pytest.fail(f"bwrap is required here (TRACE_RL_SANDBOX_TESTS=require) but not usable: {problem}")
    pytest.skip(f"isolation={isolation!r} is not usable here: {problem}")


@pytest.fixture(params=ISOLATIONS, scope="module")
def box(request: pytest.FixtureRequest) -> Sandbox:
    return _sandbox(request.param)


def fallback_cannot(box: Sandbox, what: str) -> None:
    if box.isolation == "rlimits":
        pytest.skip(f"the rlimits fallback cannot stop this by design: {what}")


def needs_own_uid(box: Sandbox) -> None:
    if box.isolation == "rlimits" and not ROOT:
        pytest.skip("the rlimits fallback runs code as our own uid when we are not root")


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (zombies have none and are not counted)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry))
    return found


def reexec_with(marker: str, code: str) -> str:
    """Code that re-executes itself as `code` with `marker` in its command line (visible in host /proc)."""
    return f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-S', '-c', {code!r}, {marker!r}])\n"


@pytest.fixture
def marker() -> str:
    return f"trace-rl-sandbox-test-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------- normal use


def test_stdout_stderr_and_exit_status(box: Sandbox) -> None:
    result = box.run("import sys\nprint('héllo ✓')\nprint('to stderr', file=sys.stderr)\nsys.exit(3)")
    assert (result.stdout, result.stderr, result.returncode) == ("héllo ✓\n", "to stderr\n", 3)
    assert not result.timed_out and not result.truncated


def test_exception_gives_traceback_of_the_code_only(box: Sandbox) -> None:
    result = box.run("def f():\n    return 1 / 0\nf()")
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback (most recent call last):\n  File \"<code>\", line 3, in <module>")
    assert "return 1 / 0" in result.stderr and result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    syntax = box.run("x = (")
    assert syntax.returncode == 1 and "SyntaxError" in syntax.stderr and "<string>" not in syntax.stderr


def test_exit_builtin_stdin_and_long_programs(box: Sandbox) -> None:
    assert box.run("print('a'); exit(4)").returncode == 4
    eof = box.run("input()")  # stdin is /dev/null: EOF at once, no hang
    assert eof.returncode == 1 and "EOFError" in eof.stderr
    long_code = "x = 0\n" + "x += 1\n" * 40_000 + "print(x)"  # ~280 KB: more than a pipe buffer
    assert box.run(long_code, timeout_s=20).stdout == "40000\n"


def test_working_directory_is_fresh_and_writable(box: Sandbox) -> None:
    code = "import os\nprint(os.listdir('.'))\nopen('notes.txt', 'w').write('x')\nprint(open('notes.txt').read())"
    first, second = box.run(code), box.run(code)
    assert first.stdout == second.stdout == "[]\nx\n", (first, second)


def test_environment_is_scrubbed(box: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("TRACE_RL_TEST_SECRET", secret)
    result = box.run("import os\nprint(dict(os.environ))")
    assert secret not in result.stdout and "TRACE_RL_TEST_SECRET" not in result.stdout
    assert "'PATH'" in result.stdout and result.returncode == 0


def test_code_runs_without_privileges(box: Sandbox) -> None:
    if not ROOT:
        pytest.skip("we are not root: nothing to drop")
    result = box.run("import os\nprint(os.getuid(), os.geteuid(), os.getgroups())\n"
                     "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])")
    uid, euid, groups, caps = result.stdout.split(maxsplit=3)
    assert int(uid) != 0 and int(euid) != 0 and groups == "[]" and caps.strip() == "0000000000000000", result


def test_only_the_standard_library_unless_site_packages(box: Sandbox) -> None:
    result = box.run("import numpy")
    assert result.returncode == 1 and "ModuleNotFoundError" in result.stderr
    if box.python is not None:
        return  # the fallback here runs another interpreter, without our packages
    pytest.importorskip("numpy")
    allowed = box.run("import numpy\nprint(numpy.arange(4).sum())", site_packages=True, timeout_s=20)
    assert allowed.stdout == "6\n", allowed


def test_installed_packages_are_hidden_unless_site_packages(box: Sandbox) -> None:
    fallback_cannot(box, "it shares the host filesystem, so installed packages are readable")
    interp = sandbox._interpreter(box.python or sys.executable)
    dirs = [*interp.site_dirs, *interp.hidden_dirs]
    code = f"import os\nfor d in {dirs!r}:\n    print(os.listdir(d) if os.path.isdir(d) else [])"
    assert box.run(code).stdout == "[]\n" * len(dirs)
    visible = box.run(code, site_packages=True).stdout.splitlines()
    assert all(line != "[]" for line in visible[: len(interp.site_dirs)])


# ---------------------------------------------------------------------------------------------- limits


LOOPS = {"cpu_loop": "print('started')\nwhile True:\n    pass", "sleep": "print('started')\nimport time\ntime.sleep(60)"}


@pytest.mark.parametrize("code", LOOPS.values(), ids=LOOPS.keys())
def test_infinite_loop_times_out(box: Sandbox, code: str) -> None:
    start = time.monotonic()
    result = box.run(code, timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + SLACK_S
    assert result.timed_out and result.returncode is None
    assert result.stdout == "started\n"  # output written before the kill is kept (unbuffered)


BOMBS = {"one_block": "x = bytearray(8 * 1024**3)", "growing": "chunks = []\nwhile True:\n    chunks.append(bytearray(32 * 1024**2))"}


@pytest.mark.parametrize("code", BOMBS.values(), ids=BOMBS.keys())
def test_memory_bomb_fails_inside(box: Sandbox, code: str) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = box.run(code, memory_mb=256, timeout_s=10)
    assert result.returncode == 1 and "MemoryError" in result.stderr and not result.timed_out
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: the host process did not grow
    assert box.run("print('still fine')").stdout == "still fine\n"


def test_fork_bomb_is_contained_and_cleaned_up(box: Sandbox, marker: str) -> None:
    # No process of the bomb ever exits, so its successful forks (one '+' each) are the processes alive at once.
    bomb = ("import os, time\nwhile True:\n    try:\n        if os.fork():\n            os.write(1, b'+')\n"
            "    except OSError:\n        time.sleep(0.001)")
    start = time.monotonic()
    result = box.run(reexec_with(marker, bomb), timeout_s=1.5, max_processes=8)
    assert time.monotonic() - start < 1.5 + SLACK_S
    assert result.timed_out
    assert 1 <= result.stdout.count("+") <= 7, result.stdout[:100]  # RLIMIT_NPROC held, even though we run as root
    assert processes_with(marker) == []
    assert subprocess.run(["true"], timeout=5).returncode == 0  # the host can still start processes


def test_max_processes_counts_the_code_itself(box: Sandbox) -> None:
    needs_own_uid(box)
    code = ("import os\nn = 0\nfor _ in range(10):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
            "    if pid == 0:\n        import time; time.sleep(5); os._exit(0)\n    n += 1\nprint(n)")
    assert box.run(code, max_processes=4).stdout == "3\n"


def test_huge_output_is_truncated_with_bounded_memory(box: Sandbox) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    once = box.run("print('y' * 300_000_000)", max_output_bytes=10_000, memory_mb=1024, timeout_s=20)
    assert once.returncode == 0 and not once.timed_out and once.truncated
    assert once.stdout == "y" * 5_000 + "\n... [299990001 bytes dropped] ...\n" + "y" * 4_999 + "\n"
    endless = box.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", max_output_bytes=10_000, timeout_s=1.0)
    assert endless.timed_out and endless.truncated
    head, _, tail = endless.stdout.partition(" bytes dropped] ...\n")
    assert head.startswith("x" * 5_000 + "\n... [") and tail == "x" * 5_000
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


def test_file_size_is_limited(box: Sandbox) -> None:
    result = box.run("open('big', 'wb').write(b'x' * (9 * 1024 * 1024))", disk_mb=8)
    assert result.returncode == 1
    assert "File too large" in result.stderr or "No space left" in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------- filesystem


def _write_attempts(paths: list[Path]) -> str:
    return ("import os\n"
            f"for path in {[str(p) for p in paths]!r}:\n"
            "    try:\n"
            "        with open(path, 'w') as f:\n"
            "            f.write('pwned')\n"
            "        print('WROTE', path)\n"
            "    except OSError as exc:\n"
            "        print('blocked', path, type(exc).__name__)\n")


def _assert_not_written(box: Sandbox, paths: list[Path]) -> None:
    try:
        result = box.run(_write_attempts(paths))
        assert "WROTE" not in result.stdout or box.isolation == "bwrap", result.stdout  # bwrap: only its own tmpfs
        for path in paths:
            assert not path.exists(), f"{path} was created on the host"
    finally:
        for path in paths:
            if path.exists():
                path.unlink()


def test_cannot_write_protected_host_paths(box: Sandbox, tmp_path: Path, marker: str) -> None:
    needs_own_uid(box)
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    result = box.run(_write_attempts([victim]))
    assert victim.read_text() == "original", result
    _assert_not_written(box, [REPO / marker, REPO / "src" / marker, Path.home() / marker, tmp_path / marker])


def test_cannot_write_world_writable_host_dirs(box: Sandbox, marker: str) -> None:
    fallback_cannot(box, "it shares the host filesystem, and /tmp, /var/tmp and /dev/shm are writable by everyone")
    _assert_not_written(box, [Path("/tmp") / marker, Path("/var/tmp") / marker, Path("/dev/shm") / marker])


def _read_attempts(paths: list[Path]) -> str:
    return ("for path in " + repr([str(p) for p in paths]) + ":\n"
            "    try:\n"
            "        print('READ', path, open(path, errors='replace').read())\n"
            "    except OSError as exc:\n"
            "        print('blocked', path, type(exc).__name__)\n")


def test_cannot_read_protected_host_files(box: Sandbox, tmp_path: Path) -> None:
    needs_own_uid(box)
    secret = f"secret-{uuid.uuid4().hex}"
    private = tmp_path / "secret.txt"
    private.write_text(secret)
    private.chmod(0o600)
    result = box.run(_read_attempts([private, Path("/etc/shadow"), Path("/root/.bash_history")]))
    assert secret not in result.stdout + result.stderr
    assert "READ" not in result.stdout, result.stdout


def test_cannot_read_world_readable_host_files(box: Sandbox, marker: str) -> None:
    fallback_cannot(box, "it shares the host filesystem, so files every user may read are readable")
    secret = f"secret-{uuid.uuid4().hex}"
    shared = Path("/tmp") / marker
    shared.mkdir(mode=0o755)
    try:
        (shared / "secret.txt").write_text(secret)
        (shared / "secret.txt").chmod(0o644)
        result = box.run(_read_attempts([shared / "secret.txt", REPO / "pyproject.toml", Path("/etc/passwd")])
                         + "import os\nprint(sorted(os.listdir('/')))")
        assert secret not in result.stdout and "READ" not in result.stdout, result.stdout
        assert "'home'" not in result.stdout and "'etc'" not in result.stdout and "'work'" not in result.stdout
    finally:
        shutil.rmtree(shared)


# ---------------------------------------------------------------------------------------------- network


def test_cannot_connect_to_host_network(box: Sandbox) -> None:
    fallback_cannot(box, "it shares the host's network namespace")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = ("import socket\n"
                f"for address in [('127.0.0.1', {port}), ('8.8.8.8', 53)]:\n"
                "    try:\n"
                "        socket.create_connection(address, timeout=1).close()\n"
                "        print('CONNECTED', address)\n"
                "    except OSError as exc:\n"
                "        print('blocked', address, exc)\n")
        result = box.run(code, timeout_s=10)
        assert "CONNECTED" not in result.stdout and result.stdout.count("blocked") == 2, result
        server.settimeout(0.3)
        with pytest.raises(socket.timeout):
            server.accept()


# ---------------------------------------------------------------------------------------------- processes


def test_cannot_kill_the_parent_or_other_processes(box: Sandbox) -> None:
    needs_own_uid(box)  # (as our own uid, kill(-1) would take down the test run itself)
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        code = ("import os, signal\n"
                f"for target in (os.getppid(), {os.getpid()}, {bystander.pid}, 1, -1):\n"
                "    try:\n"
                "        os.kill(target, signal.SIGKILL)\n"
                "        print('sent', target)\n"
                "    except OSError as exc:\n"
                "        print('failed', target, exc.errno)\n"
                "print('survived')\n")
        result = box.run(code)
        assert result.stdout.endswith("survived\n"), result
        assert bystander.poll() is None, "a host process was killed"
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("keeps_pipes", [True, False], ids=["keeps_pipes", "detached"])
def test_background_processes_die_with_the_call(box: Sandbox, marker: str, keeps_pipes: bool) -> None:
    needs_own_uid(box)
    detach = ("        null = os.open(os.devnull, os.O_RDWR)\n"
              "        for fd in (0, 1, 2):\n"
              "            os.dup2(null, fd)\n")
    code = ("import os, sys\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            + ("" if keeps_pipes else detach)
            + f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "    os._exit(0)\n"
            "os.wait()\n"
            "print('parent done')\n")
    start = time.monotonic()
    result = box.run(code, timeout_s=10)
    assert time.monotonic() - start < 5, "the call waited for the daemon"
    assert result.stdout == "parent done\n" and result.returncode == 0 and not result.timed_out, result
    assert processes_with(marker) == []


def test_concurrent_calls_are_independent(box: Sandbox) -> None:
    from concurrent.futures import ThreadPoolExecutor

    code = ("import os, time\nopen('mine', 'w').write(str({i}))\ntime.sleep(0.3)\n"
            "print(os.getuid(), os.listdir('.'), open('mine').read())")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: box.run(code.format(i=i)), range(4)))
    lines = [r.stdout.split() for r in results]
    assert [line[1:] for line in lines] == [["['mine']", str(i)] for i in range(4)], results
    if ROOT:
        assert len({line[0] for line in lines}) == 4  # a uid per call: separate process budgets


# ---------------------------------------------------------------------------------------------- choosing a level


def test_auto_falls_back_to_rlimits_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fallback = _sandbox("rlimits")
    monkeypatch.setattr(sandbox, "_bwrap_problem", lambda interp: "bwrap is not installed (test)")
    monkeypatch.setattr(sandbox, "_FALLBACK_WARNED", False)
    with caplog.at_level(logging.WARNING, logger="trace_rl.agent.sandbox"):
        results = [run_python("print(1)", python=fallback.python) for _ in range(2)]
    assert [r.isolation for r in results] == ["rlimits", "rlimits"] and results[0].stdout == "1\n"
    warnings = [r for r in caplog.records if "isolation='rlimits'" in r.getMessage()]
    assert len(warnings) == 1 and "NO network or filesystem isolation" in warnings[0].getMessage()


def test_unusable_levels_raise_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_bwrap_problem", lambda interp: "bwrap is not installed (test)")
    monkeypatch.setattr(sandbox, "_rlimits_problem", lambda interp: "no uid (test)")
    with pytest.raises(SandboxUnavailable, match=r"bwrap is not installed \(test\).*no uid \(test\)"):
        run_python("print(1)")
    with pytest.raises(SandboxUnavailable, match="isolation='bwrap' is not usable here"):
        run_python("print(1)", isolation="bwrap")


BAD = [{"timeout_s": 0}, {"timeout_s": float("inf")}, {"memory_mb": 8}, {"max_output_bytes": -1}, {"max_processes": 0},
       {"disk_mb": 1.5}, {"isolation": "docker"}]


@pytest.mark.parametrize("kwargs", BAD)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        run_python("print(1)", **kwargs)


# ---------------------------------------------------------------------------------------------- the python tool


@pytest.fixture(scope="module")
def tools() -> dict:
    if all(isolation_problem(level) for level in ISOLATIONS):
        pytest.skip("no isolation level usable with this interpreter")
    from trace_rl.agent.tools import build_tools

    return build_tools(["python"], python_timeout_s=1.0)


def test_python_tool_shows_output_errors_and_timeouts(tools: dict) -> None:
    from trace_rl.agent.tools import run_tool
    from trace_rl.agent.types import ToolCall

    ok = run_tool(tools, ToolCall("python", {"code": "print(6 * 7)"}))
    assert (ok.output, ok.error_kind) == ("42", None)
    crash = run_tool(tools, ToolCall("python", {"code": "print('partial')\n1 / 0"}))
    assert crash.ok and crash.output.startswith("partial\nstderr:\n") and "ZeroDivisionError" in crash.output
    assert crash.output.endswith("[exit code 1]")
    slow = run_tool(tools, ToolCall("python", {"code": "print('step 1')\nwhile True: pass"}))
    assert slow.error_kind == "timeout" and "step 1" in slow.output and "timed out after 1s" in slow.output
    silent = run_tool(tools, ToolCall("python", {"code": "x = 1"}))
    assert "no output" in silent.output
    empty = run_tool(tools, ToolCall("python", {"code": "   "}))
    assert empty.error_kind in ("input", "arguments")


def test_python_tool_observation_is_bounded(tools: dict) -> None:
    from trace_rl.agent.tools import run_tool
    from trace_rl.agent.types import ToolCall

    code = ("import sys\nprint('o' * 100_000)\nprint('answer: 42')\n"
            "print('e' * 50_000, file=sys.stderr)\nraise SystemExit('the end')")
    result = run_tool(tools, ToolCall("python", {"code": code}))
    assert len(result.output) <= 2000, len(result.output)
    assert result.output.startswith("ooo") and "answer: 42" in result.output  # start and end of stdout
    assert "the end" in result.output and result.output.endswith("[exit code 1; output truncated]")


def test_render_result_keeps_the_end_of_stderr() -> None:
    from trace_rl.agent.tools.python_tool import render_result

    result = ExecResult("", "noise\n" * 1000 + "ValueError: the cause", 1, False, False, "bwrap")
    text = render_result(result, timeout_s=5, max_chars=300)
    assert len(text) <= 300 and "ValueError: the cause" in text and text.endswith("[exit code 1]")
    killed = ExecResult("", "", -9, False, False, "bwrap")
    assert "SIGKILL" in render_result(killed, timeout_s=5, max_chars=300)
