"""Every name a run logs in its metrics.jsonl has a definition in `trace_rl.planning.metrics.DEFINITIONS` (what
docs/reference/metrics.md renders), and every definition names a metric the code still computes."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from test_train import scripted_parts, small_config

from trace_rl.planning.metrics import DEFINITIONS, definition
from trace_rl.run import build_trainer
from trace_rl.storage.rundir import read_metrics

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "trace_rl"
COMMITTED = [  # committed results whose runs logged method- and config-specific keys
    "docs/results/groups_paper/trace/seed_0/metrics.jsonl",
    "docs/results/groups_paper/grpo_8x8/seed_0/metrics.jsonl",
]


def _not_json(constant: str) -> None:
    raise ValueError(f"metrics.jsonl holds {constant}, which strict JSON readers (jq, JavaScript) reject")


def logged_keys(run_dir: Path) -> set[str]:
    """The keys logged, every line parsed as strict JSON (no NaN or Infinity)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {key for line in lines for key in json.loads(line, parse_constant=_not_json)}


def undefined(keys: set[str]) -> list[str]:
    return sorted(key for key in keys if definition(key) is None)


@pytest.mark.parametrize("method", ["trace", "brace", "dapo"])
def test_every_key_a_tiny_run_logs_has_a_definition(tmp_path, method):
    config = small_config(steps=2, checkpoint_every=2, eval_on_start="true")
    config.rollout.method = method
    if method == "brace":
        config.rollout.brace.group_size = 4
    trainer = build_trainer(config, scripted_parts(config, tmp_path / "cache"), tmp_path / "run")
    trainer.run()
    keys = logged_keys(tmp_path / "run")
    assert {"step", "method", "actor/pg_loss", "val/accuracy_greedy"} <= keys
    if method == "brace":
        assert "brace/correlation" in keys
    if method == "trace":
        assert "stage2/continuations" in keys or "rollout/stage2_to_roots" in keys
    assert not undefined(keys), f"logged without a definition in trace_rl.planning.metrics.DEFINITIONS: {undefined(keys)}"


@pytest.mark.parametrize("path", COMMITTED)
def test_every_key_a_committed_run_logged_has_a_definition(path):
    keys = {key for record in read_metrics(REPO / path) for key in record}
    assert "predictor/root_calibration_slope" in keys or "grpo" in path
    assert not undefined(keys), f"{path} logs keys without a definition: {undefined(keys)}"


def test_definition_matches_exact_names_first_then_patterns():
    assert definition("tree/leaves") == DEFINITIONS["tree/leaves"]
    assert definition("predictor/root_calibration_slope") == DEFINITIONS["predictor/<head>calibration_slope"]
    assert definition("predictor/calibration_slope") == DEFINITIONS["predictor/<head>calibration_slope"]
    assert definition("predictor/no_such_figure") is None and definition("tree/leaves/extra") is None


def source_without_definitions() -> str:
    """Every .py file under src/trace_rl, less the DEFINITIONS assignment itself (whose keys would
    otherwise find themselves)."""
    texts = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path == SRC / "metrics.py":
            lines = text.splitlines()
            node = next(n for n in ast.parse(text).body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "DEFINITIONS")
            text = "\n".join(lines[: node.lineno - 1] + lines[node.end_lineno :])
        texts.append(text)
    return "\n".join(texts)


def test_every_definition_names_a_key_the_code_still_writes():
    source = source_without_definitions()
    stale = []
    for key in DEFINITIONS:
        if "<" in key:  # a pattern: an f-string with a replacement field where the pattern has <...>
            parts = re.split(r"<[^>]*>", key)
            found = re.search(r"\{[^}]*\}".join(re.escape(p) for p in parts), source)
        else:
            found = re.search(rf"[\"']{re.escape(key)}[\"']", source)
        if not found:
            stale.append(key)
    assert not stale, f"defined in trace_rl.planning.metrics.DEFINITIONS but written nowhere under src/trace_rl: {stale}"
