"""Where built models are cached, and how a folder is put there: `$TRACE_RL_CACHE` (default
`~/.cache/trace-rl`), folders keyed by a hash of what determines them, each built under a temporary
name and renamed into place so a reader never sees half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "TRACE_RL_CACHE"
FORMAT_VERSION = 1
"""Bump when the tiny recipe or the SmolLM2 conversion changes, so old cache folders are not reused."""


def cache_root() -> Path:
    """Where built models live: `$TRACE_RL_CACHE`, else `~/.cache/trace-rl`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trace-rl")


@contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """Build a folder under a temporary name, then rename it into place.

    Concurrent builders (parallel test workers) each write their own temporary folder; the first
    rename wins and the others discard theirs, so readers never see a half-written folder.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
