"""docs/reference/*.md are what scripts/docs_reference.py generates from the code, and they cover it:
every run config key (each with a docstring), every CLI subcommand and option, every method."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

import pytest
from repo_files import REPO, load

from trace_rl.cli import build_parser
from trace_rl.core.advantage import ESTIMATORS
from trace_rl.core.tree import RolloutTree
from trace_rl.planning.methods import METHODS
from trace_rl.planning.metrics import tree_metrics
from trace_rl.research.compare import CompareConfig
from trace_rl.run import RunConfig

PAGES = REPO / "docs" / "reference"


@pytest.fixture(scope="module")
def script():
    return load("scripts/docs_reference.py")


@pytest.fixture(scope="module")
def pages(script) -> dict[str, str]:
    return script.generate()


def dotted_leaves(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of a config dataclass, walked here independently of the script."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += dotted_leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_committed_pages_are_what_the_script_generates(pages):
    assert set(pages) == {"config.md", "cli.md", "methods.md", "metrics.md"}
    for name, text in pages.items():
        path = PAGES / name
        assert path.is_file(), f"{path} is missing: run python scripts/docs_reference.py"
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run python scripts/docs_reference.py"


def test_generation_is_deterministic(script, pages):
    assert script.generate() == pages


def test_check_mode_names_a_stale_page(script, tmp_path, capsys):
    assert script.main(["--out", str(tmp_path)]) == 0
    assert script.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "methods.md").write_text("# stale\n", encoding="utf-8")
    capsys.readouterr()
    assert script.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "methods.md" in err and "config.md" not in err


def test_every_run_config_key_is_on_the_page_with_a_description(script, pages):
    keys = dotted_leaves(RunConfig)
    assert len(keys) > 50
    assert {"seed", "train.lr", "rollout.brace.temperature", "task.sandbox.python", "predictor.guard"} <= set(keys)
    documented = {key.dotted: key for key in script.leaf_keys(RunConfig)}
    assert sorted(documented) == sorted(keys)
    undocumented = [key for key in keys if not documented[key].doc.strip()]
    assert not undocumented, f"config keys without an attribute docstring (add one after the field): {undocumented}"
    for key in keys:
        assert f"| `{key}` |" in pages["config.md"], key


def test_comparison_keys_are_on_the_page(pages):
    for f in dataclasses.fields(CompareConfig):
        assert f"| `{f.name}` |" in pages["config.md"], f.name


def test_every_subcommand_and_option_is_on_the_cli_page(pages):
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"train", "compare", "eval", "report", "tasks", "methods"} <= set(action.choices)
    text = pages["cli.md"]
    for name, sub in action.choices.items():
        assert f"\n## {name}\n" in text, name
        for option in (o for a in sub._actions for o in a.option_strings if o not in ("-h", "--help")):
            assert f"`{option}" in text, f"{name} {option}"


def test_every_method_and_estimator_is_on_the_methods_page(pages):
    assert len(METHODS) >= 10
    for name in METHODS:
        assert f"| `{name}` |" in pages["methods.md"], name
    for name in ESTIMATORS:
        assert f"| `{name}` |" in pages["methods.md"] and f"\n### {name}\n" in pages["methods.md"], name


def test_the_metrics_page_names_every_tree_figure(pages):
    tree = RolloutTree.new("t", "question", [1, 2])
    tree.add_turn(0, token_ids=[3, 4], reward=1.0)
    tree.add_turn(0, token_ids=[5], reward=0.0)
    figures = tree_metrics([tree])
    assert "tree/effective_ratio" in figures
    for name in figures:
        assert f"- `{name}`" in pages["metrics.md"], name


@dataclass
class _Documented:
    """A section."""

    a: int = 1
    """About a."""
    b: list[str] = field(default_factory=lambda: ["x"])
    c: str | None = None
    """About c,
    on two lines."""


def test_attribute_docs_and_rendering(script):
    assert script.attribute_docs(_Documented) == {"a": "About a.", "c": "About c,\non two lines."}
    (section,) = script.walk(_Documented)
    assert section.doc == "A section."
    assert [(k.dotted, k.type, k.default) for k in section.keys] == [
        ("a", "`int`", "`1`"), ("b", "`list[str]`", '`["x"]`'), ("c", "`str` or null", "`null`"),
    ]
    assert script.prose("a | b `c | d` rg:<x> 2*3") == "a \\| b `c | d` rg:&lt;x> 2\\*3"
