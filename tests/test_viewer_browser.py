"""report.html in a real headless Chromium: it loads cleanly, draws the tree, and reacts to clicks.

Driven with Playwright's Python package against the system Chromium (Debian's `chromium`); no
browser is downloaded. Without a Chromium binary or Playwright the tests skip, unless
TRACE_RL_BROWSER_TESTS=require (set in CI), where a missing browser is a failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_report import EVIL, EVIL_OBSERVATION, PNG_MAGIC, embedded_data, write_run

REQUIRED = os.environ.get("TRACE_RL_BROWSER_TESTS") == "require"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason} (TRACE_RL_BROWSER_TESTS=require)")
    pytest.skip(reason)


def find_chromium() -> str | None:
    """$TRACE_RL_CHROMIUM, else the first Chromium-family binary on PATH or in /usr/bin."""
    explicit = os.environ.get("TRACE_RL_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").is_file() else None)
        if found:
            return found
    return None


class Page:
    """A Playwright page plus everything that should never happen on ours: errors, dialogs, network."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        page.on(
            "console",
            lambda msg: self.errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None,
        )
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("dialog", self._dialog)

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def node_count(self) -> int:
        return self.page.locator("#tv-canvas .tv-node").count()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    chromium = find_chromium()
    if chromium is None:
        _unavailable("no Chromium binary found (apt-get install chromium, or set TRACE_RL_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ModuleNotFoundError:
        _unavailable("the playwright package is not installed (pip install playwright; no `playwright install` needed)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000},
        )
        yield context
        context.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trace_rl.report import write_report

    return write_report(write_run(tmp_path_factory.mktemp("run") / "run", steps=3, trees_per_step=4))


@pytest.fixture
def page(browser: Any, report: Path) -> Iterator[Page]:
    watched = Page(browser.new_page())

    def only_local(route: Any) -> None:  # the page must need nothing from outside the file
        if route.request.url.startswith(("file:", "data:")):
            route.continue_()
        else:
            watched.requests.append(route.request.url)
            route.abort()

    watched.page.route("**/*", only_local)
    watched.page.goto(report.as_uri())
    watched.page.wait_for_selector("#tv-canvas .tv-node")
    yield watched
    watched.page.close()


def test_report_loads_cleanly_and_draws_the_last_steps_first_tree(page: Page, report: Path, tmp_path: Path) -> None:
    data = embedded_data(report.read_text(encoding="utf-8"))
    last = data["runs"][0]["steps"][-1]
    assert page.page.locator("#tv-step").input_value() == str(len(data["runs"][0]["steps"]) - 1)
    assert page.node_count() == len(last["trees"][0]["nodes"]["parent"])
    assert page.page.locator("#tv-canvas .tv-edge").count() == page.node_count() - 1
    assert page.page.locator(".plots img").count() == 7  # reward, accuracy, by rollouts, by minutes, effective ratio, mixed budget, calibration
    assert all(page.page.evaluate("Array.from(document.images).map(i => i.naturalWidth > 0)"))
    assert "Node 0 · root" in page.page.locator("#tv-detail").inner_text()
    shot = tmp_path / "report.png"
    page.page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == PNG_MAGIC
    assert page.errors == [] and page.dialogs == [] and page.requests == []


def test_clicking_a_node_shows_its_turn_as_plain_text(page: Page, report: Path) -> None:
    p = page.page
    p.select_option("#tv-step", "0")  # step 1's first tree (in its file) holds script-like model text
    offered = [t["index"] for t in embedded_data(report.read_text(encoding="utf-8"))["runs"][0]["steps"][0]["trees"]]
    p.select_option("#tv-tree", str(offered.index(0)))
    p.locator('#tv-canvas .tv-node[data-node-id="1"]').click()
    detail = p.locator("#tv-detail").inner_text()
    assert "Node 1" in detail
    assert f"thinking {EVIL}" in detail  # shown literally, never parsed
    assert EVIL_OBSERVATION.replace("\u2028", "") in detail.replace("\u2028", "").replace("\n", " ")
    assert 'search("entity mh-1-0 0")' in detail
    assert "predicted (Ṽψ)" in detail and "0.550" in detail  # node 1's prediction
    assert "2 continuations (Stage 2)" in detail
    assert p.locator('#tv-canvas .tv-node.tv-selected[data-node-id="1"]').count() == 1
    assert p.locator("script").count() == 2 and p.locator("#tv img, #tv script").count() == 0
    assert EVIL in p.locator("#tv-question").inner_text()
    leaf = p.locator('#tv-canvas .tv-node[data-node-id="2"]')
    leaf.click()
    assert "· leaf" in p.locator("#tv-detail h3").inner_text()
    p.locator("#tv-detail .tv-crumbs button", has_text="0").click()
    assert "root (the prompt)" in p.locator("#tv-detail h3").inner_text()
    assert page.errors == [] and page.dialogs == []


def test_changing_step_and_prompt_redraws_the_tree(page: Page, report: Path) -> None:
    data = embedded_data(report.read_text(encoding="utf-8"))
    steps = data["runs"][0]["steps"]
    p = page.page
    for step_index in (0, 1):
        p.select_option("#tv-step", str(step_index))
        for tree_index in (0, 1, 2):
            p.select_option("#tv-tree", str(tree_index))
            tree = steps[step_index]["trees"][tree_index]
            assert page.node_count() == len(tree["nodes"]["parent"])
            assert p.locator("#tv-question b").inner_text() == tree["task_id"]
            summary = p.locator("#tv-step-summary").inner_text()
            assert f"step {steps[step_index]['step']}" in summary
            most = steps[step_index]["metrics"]["tree/most_leaves_unmixed"]
            assert f"most on one unmixed prompt {most:.0f}" in summary
    assert p.locator("#tv-tree option").count() == len(steps[1]["trees"])
    assert page.errors == [] and page.dialogs == []
