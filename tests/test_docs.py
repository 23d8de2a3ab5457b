"""The documentation runs: every tutorial's code blocks, in order, from an empty folder.

A tutorial page (`docs/tutorials/*.md`, and the how-to on resuming) is a script read top to bottom: a ```python block runs in a
fresh interpreter, a ```bash block in bash (`set -euo pipefail`), both in one temporary folder that
holds a link to the repository's `configs/` and `examples/`, so files one block writes are there for
the next. An HTML comment before a block changes what happens to it:

    <!-- file: NAME -->    the block is written to NAME instead of run
    <!-- test: slow -->    the block runs only with `-m slow` (a real model, minutes)
    <!-- test: skip -->    the block is not run (a GPU, a cluster); say why in the page

Blocks in other languages (yaml, console, text) are shown, not run, unless a `file:` comment saves them.
The README's links and the site's build are checked here too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TUTORIALS = [*sorted((REPO / "docs" / "tutorials").glob("*.md")), REPO / "docs" / "how-to" / "resume.md"]
FENCE = re.compile(r"(?:<!--\s*(?P<directive>file|test):\s*(?P<arg>[^>]*?)\s*-->\s*\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)\n```",
                   re.DOTALL)


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    directive: str | None
    arg: str | None
    line: int


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(m["lang"], m["body"], m["directive"], m["arg"], text.count("\n", 0, m.start("lang")) + 1)
            for m in FENCE.finditer(text)]


def _runs(block: Block, slow: bool) -> bool:
    if block.directive == "file":
        return False
    if block.directive == "test":
        if block.arg == "skip":
            return False
        if block.arg == "slow":
            return slow
        raise ValueError(f"unknown test directive {block.arg!r} (line {block.line}): use slow or skip")
    return block.lang in ("python", "bash")


def run_page(page: Path, folder: Path, *, slow: bool = False) -> list[Block]:
    """Run `page`'s blocks in `folder`; returns the blocks that ran. A failing block fails with its line."""
    for name in ("configs", "examples"):
        (folder / name).symlink_to(REPO / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(folder)]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "TRACE_RL_CACHE": str(folder / ".cache")}
    ran = []
    for block in blocks(page):
        if block.directive == "file":
            (folder / block.arg).write_text(block.body + "\n")
            continue
        if not _runs(block, slow):
            continue
        if block.lang == "python":
            command = [sys.executable, "-c", block.body]
        else:  # `trace-rl` is the console script of the package's install; the tests run from the source tree
            command = ["bash", "-c", "set -euo pipefail\ntrace-rl() { python -m trace_rl \"$@\"; }\n" + block.body]
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900, check=False)
        assert done.returncode == 0, f"{page.name}:{block.line}: the {block.lang} block failed\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        ran.append(block)
    return ran


def test_the_block_reader_sees_directives_languages_and_lines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n<!-- file: a.py -->\n```python\nX = 1\n```\n\n```bash\necho hi > out.txt\n```\n\n"
                    "<!-- test: skip -->\n```bash\nexit 1\n```\n\n```yaml\nk: v\n```\n\n"
                    "```python\nimport a, pathlib\nassert a.X == 1 and pathlib.Path('out.txt').read_text() == 'hi\\n'\n```\n")
    found = blocks(page)
    assert [(b.lang, b.directive, b.arg, b.line) for b in found] == [
        ("python", "file", "a.py", 4), ("bash", None, None, 8), ("bash", "test", "skip", 13), ("yaml", None, None, 17),
        ("python", None, None, 21)]
    work = tmp_path / "work"
    work.mkdir()
    assert [b.line for b in run_page(page, work)] == [8, 21]
    page.write_text("```bash\nfalse\n```\n")
    (tmp_path / "work2").mkdir()
    with pytest.raises(AssertionError, match="page.md:1: the bash block failed"):
        run_page(page, tmp_path / "work2")


@pytest.mark.parametrize("page", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_a_tutorial_runs_top_to_bottom(page, tmp_path):
    ran = run_page(page, tmp_path)
    assert ran or all(b.directive == "test" for b in blocks(page) if b.lang in ("python", "bash")), f"{page.name} runs nothing"


@pytest.mark.slow
@pytest.mark.parametrize("page", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_a_tutorial_runs_with_its_slow_blocks(page, tmp_path):
    run_page(page, tmp_path, slow=True)


def test_the_readme_links_only_to_files_that_exist():
    text = (REPO / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    assert targets, "the README links into the docs"
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 12_000, f"README.md is {len(text.encode())} bytes; details go to docs/"
    for heading in ("## Quick start", "## Results at a glance", "## What runs where"):
        assert heading in text


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is not installed (the `docs` extra; `make docs` installs it)")
def test_the_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert "results/paper_main/index.html" in pages  # a generated comparison page
    assert "tutorials/own-task/index.html" in pages
