"""The agent's `python` tool: run a model-written program in the sandbox, show the model what happened.

The observation is the program's stdout, then the tail of its stderr (where tracebacks end), then one
status line when something went wrong (exit code, signal, time limit, truncated output), cut to
`max_chars` characters. A timed-out run raises `ToolTimeoutError` carrying the same observation, so
`run_tool` records it as a timeout and the model still sees the partial output.
"""

from __future__ import annotations

import signal
from typing import Literal

from trace_rl.agent.sandbox import ExecResult, check_sandbox, run_python
from trace_rl.agent.tools.base import Tool, ToolInputError, ToolTimeoutError

MAX_CODE_CHARS = 20_000
"""Longer programs are refused before they run (a model writing this much is stuck in a loop)."""

_DESCRIPTION = (
    "Run a Python 3 program and return what it prints (stdout, then the end of stderr). Each call "
    "starts fresh: no variables or files survive between calls, so print() every value you need. "
    "{packages} No network access; the program is stopped after {timeout:g} seconds."
)


def python_tool(
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_chars: int = 2000,
    site_packages: bool = False,
    isolation: Literal["auto", "bwrap", "rlimits"] = "auto",
    interpreter: str | None = None,
) -> Tool:
    """The `python` tool with these limits. `site_packages=True` lets programs import the installed packages.

    `isolation` and `interpreter` (`run_python`'s `python`) choose the sandbox. They are checked now, so a machine that
    cannot run model code fails with `SandboxUnavailable` before any work, not at the first call.
    """
    if max_chars < 200:
        raise ValueError(f"max_chars must be >= 200, got {max_chars!r}")
    check_sandbox(isolation, interpreter)

    def python(code: str) -> str:
        if not code.strip():
            raise ToolInputError("empty program")
        if len(code) > MAX_CODE_CHARS:
            raise ToolInputError(f"program too long ({len(code)} characters; at most {MAX_CODE_CHARS})")
        # Keep only what can be shown (UTF-8 takes at most 4 bytes a character).
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=4 * max_chars,
                            site_packages=site_packages, isolation=isolation, python=interpreter)
        observation = render_result(result, timeout_s=timeout_s, max_chars=max_chars)
        if result.timed_out:
            raise ToolTimeoutError(observation)
        return observation

    packages = "Installed packages (e.g. numpy) can be imported." if site_packages else "Only the standard library is available."
    return Tool.from_function(
        python,
        description=_DESCRIPTION.format(packages=packages, timeout=timeout_s),
        params={"code": "a complete Python program; print() the results you want to see"},
    )


def render_result(result: ExecResult, *, timeout_s: float, max_chars: int) -> str:
    """What the model sees of one run, at most `max_chars` characters.

    Worked example: stdout "42\\n", stderr "", exit 0 -> "42"; a crash -> the traceback's last lines
    under "stderr:" and "[exit code 1]"; nothing printed -> a hint to print. Long stdout keeps its
    start and end, long stderr its end.
    """
    status = []
    if result.timed_out:
        status.append(f"timed out after {timeout_s:g}s: the program was stopped")
    elif result.returncode is not None and result.returncode < 0:
        status.append(f"killed by {_signal_name(-result.returncode)} (a resource limit: CPU time, memory or file size)")
    elif result.returncode:
        status.append(f"exit code {result.returncode}")
    if result.truncated:
        status.append("output truncated")
    footer = f"[{'; '.join(status)}]" if status else ""
    stdout, stderr = result.stdout.rstrip(), result.stderr.rstrip()
    if not (stdout or stderr or footer):
        return "(no output; print() the values you want to see)"

    room = max_chars - len(footer) - 2
    err_room = min(len(stderr) + 8, room // 2 if stdout else room)  # 8: "stderr:\n"
    out_room = room - (err_room if stderr else 0)
    parts = []
    if stdout:
        parts.append(_clip(stdout, out_room, head_share=0.5))  # the start, and the result printed last
    if stderr:
        parts.append("stderr:\n" + _clip(stderr, err_room - 8, head_share=0.0))  # where the traceback ends
    if footer:
        parts.append(footer)
    return "\n".join(parts)[:max_chars]


def _clip(text: str, room: int, *, head_share: float) -> str:
    """`text` in at most `room` characters: its start and end, the middle replaced by a note."""
    if len(text) <= room:
        return text
    note = f"\n... [{len(text)} characters; middle cut] ...\n"
    keep = max(room - len(note), 0)
    head = int(keep * head_share)
    return text[:head] + note + text[len(text) - (keep - head):]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
