"""A self-contained HTML viewer for rollout trees: pick a run, a step and a prompt, click a node.

The page carries its data as JSON inside `<script type="application/json">` and draws the tree as
SVG with inline JS: no network, no external files. Model text is untrusted, so it is only ever set
with `textContent` (never `innerHTML`), and the embedded JSON escapes `<`, `>` and `&` so no text can
close the script element.

The data is bounded so the page stays small: a few evenly spaced steps per run, the most telling trees
of each step (`showcase_order`: mixed first; a TRACE step samples only some of its candidates, so the
file's order would open on prompts that got no rollout), the first nodes of very large trees (ids are
dense with parents first, so a prefix of the node list is still a tree), and texts cut with a visible
marker to fit a byte budget.

Embedded data (`viewer_data`), for reference when changing the JS:

    {"runs": [{"label", "path", "steps": [{"step", "file", "trees_total", "trees_sampled", "metrics": {...},
               "error": str | null, "trees": [TREE, ...]}]}],
     "limits": {...}, "text_chars": int, "warnings": [str]}
    TREE = {"index" (its line in the step's file, from 0), "task_id", "prompt", "source", "nodes_total",
            "leaves", "successes", "mixed",
            "nodes": {"parent": [...], "depth": [...], "thought": [...], "action": [...],
                      "observation": [...], "info": [...], "reward": [...], "value": [...],
                      "leaves": [...], "predicted": [...], "stage2_value": [...], "budget": [...], "mixed_anchor": [...],
                      "tokens": [...], "trained_tokens": [...]}}

`nodes` is column-oriented (one list per field, indexed by node id) to keep key names out of the
per-node cost. `value` is the tree backup V̂ (mean leaf reward below the node; null with no finished
leaf below), `leaves` the count of finished leaves below it.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trace_rl.core.tree import RolloutTree, read_jsonl, subtree_rewards
from trace_rl.planning.metrics import tree_metrics
from trace_rl.storage.rundir import RunDir, atomic_write


@dataclass(frozen=True)
class ViewerLimits:
    """Bounds on what the viewer embeds. The defaults keep a page to a few MB."""

    max_steps: int = 8
    """Steps per run: evenly spaced over the run, first and last included."""
    max_trees_per_step: int = 16
    """Trees per step, the first in `showcase_order`."""
    max_nodes_per_tree: int = 400
    """Nodes per tree; bigger trees keep their first nodes (ids are parents-first, so still a tree)."""
    max_text_chars: int = 2000
    """Longest text kept per field (thought, action, observation, info, prompt)."""
    min_text_chars: int = 160
    """Texts are cut down to this before whole trees are dropped to meet `max_bytes`."""
    max_bytes: int = 4_000_000
    """Approximate budget for the embedded JSON."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_trees_per_step", "max_nodes_per_tree", "min_text_chars", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ViewerLimits.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_text_chars < self.min_text_chars:
            raise ValueError(
                f"ViewerLimits.max_text_chars ({self.max_text_chars}) must be >= min_text_chars ({self.min_text_chars})"
            )


_NODE_OVERHEAD = 110
"""Rough JSON bytes per node besides its texts (numbers, nulls, commas), for the size estimate."""
_TEXT_FIELDS = ("thought", "action", "observation", "info")


# ---------------------------------------------------------------- data


def viewer_data(runs: Sequence[tuple[str, str | Path]], limits: ViewerLimits | None = None) -> dict[str, Any]:
    """Everything the viewer shows, for runs given as (label, run folder) pairs.

    Step files that fail to load are listed with their error instead of their trees, and named in
    `warnings`, so one bad file does not hide the rest of a run.
    """
    limits = limits or ViewerLimits()
    warnings: list[str] = []
    loaded = []  # (label, path, [(step, file, trees | None, error)])
    for label, run_dir in runs:
        files = RunDir(run_dir).tree_files()
        chosen = _spread(list(files), limits.max_steps)
        steps = []
        for step in chosen:
            try:
                trees = read_jsonl(files[step])
            except (OSError, ValueError) as exc:
                warnings.append(f"{label}: step {step}: {exc}")
                steps.append((step, files[step], None, str(exc)))
                continue
            order = showcase_order(trees)
            steps.append((step, files[step], [(int(i), trees[i]) for i in order], None))
        loaded.append((label, Path(run_dir), steps))

    trees_per_step, text_chars = _fit(loaded, limits)
    if text_chars < limits.max_text_chars:
        warnings.append(f"viewer: texts cut to {text_chars} characters to keep the page near {limits.max_bytes} bytes")
    if trees_per_step < limits.max_trees_per_step:
        warnings.append(f"viewer: showing at most {trees_per_step} trees per step to keep the page small")

    out_runs = []
    for label, run_dir, steps in loaded:
        out_steps = []
        for step, file, shown, error in steps:
            trees = [tree for _, tree in shown or []]
            out_steps.append(
                {
                    "step": step,
                    "file": file.name,
                    "trees_total": len(trees),
                    "trees_sampled": sum(tree.leaf_rewards().size > 0 for tree in trees),
                    "metrics": _rounded(tree_metrics(trees)) if trees else {},
                    "error": error,
                    "trees": [
                        {"index": index, **_tree_data(tree, text_chars, limits.max_nodes_per_tree)}
                        for index, tree in (shown or [])[:trees_per_step]
                    ],
                }
            )
        out_runs.append({"label": label, "path": str(run_dir), "steps": out_steps})
    return {"runs": out_runs, "limits": asdict(limits), "text_chars": text_chars, "warnings": warnings}


def showcase_order(trees: Sequence[RolloutTree]) -> np.ndarray:
    """The order the viewer offers a step's trees in: mixed trees (a success and a failure) first, then
    the other trees that got rollouts, then prompts with none; within each, the most leaves first (Stage
    2's expansions), and the file's order on ties."""
    leaves = np.array([tree.leaf_rewards().size for tree in trees], dtype=np.int64)
    group = np.array([0 if tree.is_mixed() else 1 if n else 2 for tree, n in zip(trees, leaves)], dtype=np.int64)
    return np.lexsort((np.arange(len(trees)), -leaves, group))


def _spread(items: list[int], count: int) -> list[int]:
    """At most `count` items, evenly spaced, first and last included."""
    if len(items) <= count:
        return items
    picks = np.unique(np.round(np.linspace(0, len(items) - 1, count)).astype(int))
    return [items[i] for i in picks]


def _fit(loaded: list[Any], limits: ViewerLimits) -> tuple[int, int]:
    """The most trees per step, then the longest text cut, whose estimated JSON fits `max_bytes`."""
    for per_step in range(limits.max_trees_per_step, 0, -1):
        lengths = []  # every text's length, for the estimate
        nodes = 0
        for _, _, steps in loaded:
            for _, _, trees, _ in steps:
                for _, tree in (trees or [])[:per_step]:
                    kept = tree.nodes[: limits.max_nodes_per_tree]
                    nodes += len(kept)
                    lengths.append(len(tree.prompt))
                    lengths += [len(n.thought) for n in kept] + [len(n.action) for n in kept]
                    lengths += [len(n.observation) for n in kept] + [len(_info_text(n.info)) for n in kept]
        sizes = np.array(lengths, dtype=np.int64)
        if _estimate(sizes, nodes, limits.min_text_chars) > limits.max_bytes and per_step > 1:
            continue
        low, high = limits.min_text_chars, limits.max_text_chars  # largest cut that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if _estimate(sizes, nodes, mid) <= limits.max_bytes else (low, mid - 1)
        return per_step, low
    raise AssertionError("unreachable: per_step == 1 always returns")


def _estimate(text_lengths: np.ndarray, nodes: int, cut: int) -> int:
    """Approximate JSON bytes with every text cut at `cut` characters (48: the cut marker)."""
    return int(np.minimum(text_lengths, cut + 48).sum()) + nodes * _NODE_OVERHEAD


def _tree_data(tree: RolloutTree, text_chars: int, max_nodes: int) -> dict[str, Any]:
    backup = tree.backup()  # on the whole tree, before any nodes are dropped
    mixed = subtree_rewards(tree).mixed
    nodes = tree.nodes[:max_nodes]
    rewards = tree.leaf_rewards()
    return {
        "task_id": tree.task_id,
        "prompt": _cut(tree.prompt, text_chars),
        "source": str(tree.meta.get("source", "")),
        "nodes_total": len(tree.nodes),
        "leaves": int(rewards.size),
        "successes": int(np.sum(rewards > 0)),
        "mixed": tree.is_mixed(),
        "nodes": {
            "parent": [-1 if n.parent is None else n.parent for n in nodes],
            "depth": [n.depth for n in nodes],
            "thought": [_cut(n.thought, text_chars) for n in nodes],
            "action": [_cut(n.action, text_chars) for n in nodes],
            "observation": [_cut(n.observation, text_chars) for n in nodes],
            "info": [_cut(_info_text(n.info), text_chars) for n in nodes],
            "reward": [_num(n.reward) for n in nodes],
            "value": [_num(backup.values[n.id]) for n in nodes],
            "leaves": [int(backup.counts[n.id]) for n in nodes],
            "predicted": [_num(n.predicted) for n in nodes],
            "stage2_value": [_num(n.stage2_value) for n in nodes],
            "budget": [int(n.budget) for n in nodes],
            "mixed_anchor": [int(len(n.children) >= 2 and mixed[n.id]) for n in nodes],
            "tokens": [len(n.token_ids) for n in nodes],
            "trained_tokens": [int(sum(n.mask)) for n in nodes],
        },
    }


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… [cut: {len(text) - limit} more characters]"


def _info_text(info: dict[str, Any]) -> str:
    return json.dumps(info, ensure_ascii=False, sort_keys=True, default=str) if info else ""


def _num(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(float(value), 4)


def _rounded(metrics: dict[str, float]) -> dict[str, float | None]:
    return {key: _num(value) for key, value in metrics.items()}


def embed_json(data: Any) -> str:
    """JSON safe inside an HTML `<script>` element: `<`, `>`, `&` escaped, so `</script>` and `<!--` cannot occur."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# ---------------------------------------------------------------- HTML


def viewer_section(data: dict[str, Any]) -> str:
    """The viewer as an HTML fragment (style, controls, data, script) to place in any page's body."""
    return (
        f"<style>{VIEWER_CSS}</style>\n"
        f"{VIEWER_MARKUP}\n"
        f'<script type="application/json" id="tv-data">{embed_json(data)}</script>\n'
        f"<script>{VIEWER_JS}</script>"
    )


def viewer_page(data: dict[str, Any], title: str = "trace-rl rollout trees") -> str:
    """A complete standalone HTML document holding only the viewer."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title></head>\n<body>\n{viewer_section(data)}\n</body></html>\n"
    )


def write_viewer(run_dir: str | Path, out: str | Path | None = None, limits: ViewerLimits | None = None) -> Path:
    """Write a standalone viewer page for one run folder (default `RUN_DIR/trees.html`)."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "trees.html"
    page = viewer_page(viewer_data([(run_dir.name, run_dir)], limits))
    atomic_write(out, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    return out


VIEWER_CSS = """
.tv { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d232a; }
.tv * { box-sizing: border-box; }
.tv-controls { display: flex; flex-wrap: wrap; gap: 10px 18px; align-items: center; margin: 6px 0 10px; }
.tv-controls label { font-weight: 600; font-size: 13px; }
.tv-controls select { margin-left: 6px; font: inherit; padding: 3px 4px; max-width: 60vw; }
.tv-summary { color: #4a5560; font-size: 13px; margin: 2px 0; }
.tv-question { font-size: 15px; margin: 6px 0 4px; white-space: pre-wrap; overflow-wrap: anywhere; }
.tv-question b { font-family: ui-monospace, Menlo, Consolas, monospace; font-weight: 600; }
.tv-main { display: grid; grid-template-columns: minmax(0, 1fr) minmax(320px, 460px); gap: 14px; align-items: start; }
@media (max-width: 900px) { .tv-main { grid-template-columns: 1fr; } }
.tv-canvas { border: 1px solid #d5dbe1; border-radius: 6px; overflow: auto; max-height: 78vh; background: #fbfcfd; }
.tv-canvas svg { display: block; }
.tv-node { cursor: pointer; }
.tv-node rect.tv-hit { fill: transparent; pointer-events: all; }
.tv-node:hover rect.tv-hit { fill: rgba(43, 49, 56, 0.06); }
.tv-node circle.tv-dot { stroke: #2b3138; stroke-width: 1; }
.tv-node:hover circle.tv-dot, .tv-node:focus circle.tv-dot { stroke-width: 2.5; }
.tv-node:focus { outline: none; }
.tv-node.tv-selected circle.tv-dot { stroke: #000; stroke-width: 3; }
.tv-node circle.tv-ring { fill: none; stroke: #7b3294; stroke-width: 2.5; }
.tv-node text { font: 11px ui-monospace, Menlo, Consolas, monospace; fill: #1d232a;
  paint-order: stroke; stroke: #fbfcfd; stroke-width: 3px; stroke-linejoin: round; }
.tv-node text.tv-budget { fill: #7b3294; font-weight: 700; }
.tv-edge { fill: none; stroke-width: 1.6; opacity: 0.75; }
.tv-edge.tv-path { stroke-width: 3.2; opacity: 1; }
.tv-detail { border: 1px solid #d5dbe1; border-radius: 6px; padding: 10px 12px; background: #fff;
  max-height: 78vh; overflow: auto; }
.tv-detail h3 { margin: 0 0 6px; font-size: 15px; }
.tv-detail h4 { margin: 10px 0 3px; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: #5b6670; }
.tv-detail pre { margin: 0; padding: 6px 8px; background: #f4f6f8; border-radius: 4px; white-space: pre-wrap;
  overflow-wrap: anywhere; font: 12.5px/1.45 ui-monospace, Menlo, Consolas, monospace; max-height: 40vh; overflow: auto; }
.tv-detail pre.tv-empty { color: #8a949c; font-style: italic; }
.tv-stats { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; font-size: 13px; margin: 0; }
.tv-stats dt { color: #5b6670; }
.tv-stats dd { margin: 0; font-family: ui-monospace, Menlo, Consolas, monospace; }
.tv-crumbs { font-size: 12px; margin: 4px 0 2px; }
.tv-crumbs button { font: 12px ui-monospace, Menlo, Consolas, monospace; border: 1px solid #c9d0d6; background: #f4f6f8;
  border-radius: 3px; padding: 0 5px; margin: 0 2px 2px 0; cursor: pointer; }
.tv-legend { display: flex; flex-wrap: wrap; gap: 4px 16px; align-items: center; font-size: 12px; color: #4a5560; margin: 6px 0; }
.tv-legend .tv-scale { display: inline-block; width: 120px; height: 10px; border-radius: 2px; vertical-align: middle;
  background: linear-gradient(to right, #d73027, #fee08b, #1a9850); margin: 0 4px; }
.tv-legend .tv-swatch { display: inline-block; width: 11px; height: 11px; border-radius: 50%;
  vertical-align: middle; margin-right: 4px; }
.tv-message { color: #8a2d2d; font-size: 13px; }
"""

VIEWER_MARKUP = """<section class="tv" id="tv">
<div class="tv-controls">
  <label>Run<select id="tv-run"></select></label>
  <label>Step<select id="tv-step"></select></label>
  <label>Prompt<select id="tv-tree"></select></label>
</div>
<div class="tv-summary" id="tv-step-summary"></div>
<div class="tv-question" id="tv-question"></div>
<div class="tv-summary" id="tv-tree-summary"></div>
<div class="tv-legend">
  <span>leaf reward / backed-up value V̂: 0<span class="tv-scale"></span>1</span>
  <span><span class="tv-swatch" style="background:#b8bec4"></span>no finished leaf below</span>
  <span><span class="tv-swatch" style="border:2.5px solid #7b3294"></span>mixed anchor (success and failure below)</span>
  <span><b style="color:#7b3294">m=</b> Stage-1 budget of the prompt</span>
  <span><b style="color:#7b3294">+k</b> Stage-2 budget given to a prefix</span>
</div>
<div class="tv-message" id="tv-message"></div>
<div class="tv-main">
  <div class="tv-canvas" id="tv-canvas"></div>
  <div class="tv-detail" id="tv-detail"></div>
</div>
</section>"""

VIEWER_JS = r"""
(function () {
  "use strict";
  var SVGNS = "http://www.w3.org/2000/svg";
  var data = JSON.parse(document.getElementById("tv-data").textContent);
  var $ = function (id) { return document.getElementById(id); };
  var state = { run: 0, step: 0, tree: 0, node: 0 };
  var COL = 235, ROW = 26, PAD = 20;

  function make(tag, cls, text) {
    var el = document.createElement(tag);
    if (cls) el.className = cls;
    if (text !== undefined && text !== null) el.textContent = String(text);
    return el;
  }
  function svg(tag, attrs) {
    var el = document.createElementNS(SVGNS, tag);
    for (var k in attrs) el.setAttribute(k, attrs[k]);
    return el;
  }
  function fmt(x, digits) {
    if (x === null || x === undefined) return "—";
    return Number(x).toFixed(digits === undefined ? 3 : digits);
  }
  function clear(el) { while (el.firstChild) el.removeChild(el.firstChild); }
  function fill(select, labels, chosen) {
    clear(select);
    labels.forEach(function (label, i) {
      var opt = make("option", null, label);
      opt.value = String(i);
      select.appendChild(opt);
    });
    select.value = String(chosen);
    select.disabled = labels.length <= 1;
  }
  function oneLine(text, n) {
    var s = String(text || "").replace(/\s+/g, " ").trim();
    return s.length > n ? s.slice(0, n - 1) + "…" : s;
  }
  // 0 -> red, 0.5 -> yellow, 1 -> green (ColorBrewer RdYlGn ends); null -> grey.
  function color(v) {
    if (v === null || v === undefined) return "#b8bec4";
    var a = [215, 48, 39], b = [254, 224, 139], c = [26, 152, 80];
    var t = Math.max(0, Math.min(1, v)), from = t < 0.5 ? a : b, to = t < 0.5 ? b : c;
    var u = t < 0.5 ? t * 2 : (t - 0.5) * 2;
    return "rgb(" + from.map(function (x, i) { return Math.round(x + (to[i] - x) * u); }).join(",") + ")";
  }

  function currentRun() { return data.runs[state.run]; }
  function currentStep() { var r = currentRun(); return r ? r.steps[state.step] : undefined; }
  function currentTree() { var s = currentStep(); return s ? s.trees[state.tree] : undefined; }

  function fillRuns() {
    fill($("tv-run"), data.runs.map(function (r) { return r.label; }), state.run);
    $("tv-run").parentNode.style.display = data.runs.length > 1 ? "" : "none";
  }
  function fillSteps() {
    var run = currentRun();
    fill($("tv-step"), run ? run.steps.map(function (s) {
      return "step " + s.step + (s.error ? " (unreadable)" : " · " + s.trees.length + " of " + s.trees_total + " trees");
    }) : [], state.step);
  }
  function fillTrees() {
    var step = currentStep();
    fill($("tv-tree"), step ? step.trees.map(function (t) {
      return t.task_id + " · " + t.successes + "/" + t.leaves + " solved" + (t.mixed ? " · mixed" : "") +
        " · " + oneLine(t.prompt, 70);
    }) : [], state.tree);
  }

  function showStep() {
    var step = currentStep(), summary = $("tv-step-summary"), message = $("tv-message");
    clear(summary); clear(message);
    if (!step) {
      message.textContent = data.runs.length ? "This run has no rollout trees (no trees/step_*.jsonl files)." :
        "No rollout trees to show.";
      return;
    }
    if (step.error) { message.textContent = "Could not read " + step.file + ": " + step.error; return; }
    var m = step.metrics;
    summary.textContent = "step " + step.step + " (" + step.file + "): " + step.trees_total + " trees, " +
      step.trees_sampled + " with rollouts; showing " + step.trees.length + ", mixed first · effective ratio " +
      fmt(m["tree/effective_ratio"], 2) + " · mixed budget share " +
      fmt(m["tree/mixed_budget_share"], 2) + " · leaves " + fmt(m["tree/leaves"], 0) +
      " · most on one unmixed prompt " + fmt(m["tree/most_leaves_unmixed"], 0);
  }

  function layout(tree) {
    // Leaves take consecutive rows in depth-first order; a parent sits midway between its first and last child.
    var n = tree.nodes.parent.length, kids = [], rowOf = new Array(n), i;
    for (i = 0; i < n; i++) kids.push([]);
    for (i = 1; i < n; i++) kids[tree.nodes.parent[i]].push(i);
    var order = [], stack = [0];
    while (stack.length) {
      var id = stack.pop();
      order.push(id);
      for (var j = kids[id].length - 1; j >= 0; j--) stack.push(kids[id][j]);
    }
    var row = 0;
    order.forEach(function (id) { if (!kids[id].length) rowOf[id] = row++; });
    for (i = order.length - 1; i >= 0; i--) {
      var k = kids[order[i]];
      if (k.length) rowOf[order[i]] = (rowOf[k[0]] + rowOf[k[k.length - 1]]) / 2;
    }
    return { kids: kids, row: rowOf, rows: Math.max(row, 1) };
  }

  function nodeColor(tree, id) {
    var r = tree.nodes.reward[id];
    return r !== null ? color(r) : color(tree.nodes.value[id]);
  }

  function nodeLabel(tree, id) {
    var N = tree.nodes;
    if (id === 0) return "prompt" + (N.value[0] !== null ? " V̂=" + fmt(N.value[0], 2) : "");
    var text = oneLine(N.action[id] || N.thought[id] || N.observation[id], 25);
    if (N.reward[id] !== null) text = (N.reward[id] > 0 ? "✓ " : "✗ ") + text;
    return text;
  }

  function showTree() {
    var tree = currentTree(), canvas = $("tv-canvas"), q = $("tv-question"), ts = $("tv-tree-summary");
    clear(canvas); clear(q); clear(ts); clear($("tv-detail"));
    if (!tree) return;
    q.appendChild(make("b", null, tree.task_id));
    q.appendChild(document.createTextNode("  " + tree.prompt));
    var N = tree.nodes;
    ts.textContent = tree.leaves + " leaves, " + tree.successes + " solved" + (tree.mixed ? " (mixed)" : "") +
      " · V̂(root) " + fmt(N.value[0], 2) + " · predicted v " + fmt(N.predicted[0], 2) + " · Stage-1 budget m=" +
      N.budget[0] + " · " + tree.nodes_total + " nodes" +
      (tree.nodes_total > N.parent.length ? " (first " + N.parent.length + " shown)" : "") +
      (tree.source ? " · " + tree.source : "");

    var L = layout(tree), n = N.parent.length, maxDepth = 0, i;
    for (i = 0; i < n; i++) maxDepth = Math.max(maxDepth, N.depth[i]);
    var width = PAD * 2 + maxDepth * COL + 230, height = PAD * 2 + (L.rows - 1) * ROW + 10;
    var root = svg("svg", { width: width, height: height, viewBox: "0 0 " + width + " " + height, role: "img" });
    root.setAttribute("aria-label", "rollout tree of " + tree.task_id);
    var edges = svg("g", {}), nodes = svg("g", {}), labels = new Array(n);
    root.appendChild(edges); root.appendChild(nodes);
    function xy(id) { return [PAD + 12 + N.depth[id] * COL, PAD + L.row[id] * ROW]; }
    for (i = 0; i < n; i++) {
      var at = xy(i), g = svg("g", { "class": "tv-node", transform: "translate(" + at[0] + "," + at[1] + ")",
        tabindex: "0", role: "button" });
      g.setAttribute("data-node-id", String(i));
      if (N.mixed_anchor[i]) g.appendChild(svg("circle", { "class": "tv-ring", r: 11 }));
      g.appendChild(svg("circle", { "class": "tv-dot", r: N.reward[i] !== null ? 6 : 7.5, fill: nodeColor(tree, i) }));
      labels[i] = svg("text", { x: 13, y: 4 });
      labels[i].textContent = nodeLabel(tree, i);
      g.appendChild(labels[i]);
      var budget = i === 0 ? (N.budget[0] ? "m=" + N.budget[0] : "") : (N.budget[i] ? "+" + N.budget[i] : "");
      if (budget) {
        var b = svg("text", { "class": "tv-budget", x: i === 0 ? -10 : -6, y: -12 });
        b.textContent = budget;
        g.appendChild(b);
      }
      var tip = svg("title", {});
      tip.textContent = "node " + i + (N.reward[i] !== null ? " · reward " + fmt(N.reward[i], 2) : " · V̂ " +
        fmt(N.value[i], 2) + " over " + N.leaves[i] + " leaves");
      g.appendChild(tip);
      nodes.appendChild(g);
    }
    canvas.appendChild(root);
    var right = 0, labelWidth = new Array(n);
    for (i = 0; i < n; i++) {
      labelWidth[i] = labels[i].getComputedTextLength() || labels[i].textContent.length * 6.6;
      right = Math.max(right, xy(i)[0] + 13 + labelWidth[i]);  // fit the width to the longest label drawn
      // One clickable band over the dot and its label, so clicks between glyphs still hit the node.
      var hit = svg("rect", { "class": "tv-hit", x: -11, y: -11, width: 26 + labelWidth[i], height: 22 });
      labels[i].parentNode.insertBefore(hit, labels[i].parentNode.firstChild);
    }
    width = Math.ceil(right + PAD);
    root.setAttribute("width", width);
    root.setAttribute("viewBox", "0 0 " + width + " " + height);
    // Edges leave a node after its label, so no edge runs through text.
    for (i = 1; i < n; i++) {
      var parent = N.parent[i], p = xy(parent), c = xy(i);
      var x0 = Math.min(p[0] + 13 + labelWidth[parent] + 5, c[0] - 30), x1 = c[0] - 9, mid = (x0 + x1) / 2;
      var edge = svg("path", { "class": "tv-edge", d: "M" + x0 + "," + p[1] + " C" + mid + "," + p[1] + " " + mid +
        "," + c[1] + " " + x1 + "," + c[1], stroke: nodeColor(tree, i) });
      edge.setAttribute("data-child", String(i));
      edges.appendChild(edge);
    }
    selectNode(0);
  }

  function section(parent, title, text) {
    parent.appendChild(make("h4", null, title));
    var empty = text === null || text === undefined || text === "";
    parent.appendChild(make("pre", empty ? "tv-empty" : null, empty ? "(empty)" : text));
  }

  function selectNode(id) {
    var tree = currentTree();
    if (!tree) return;
    var N = tree.nodes, detail = $("tv-detail");
    state.node = id;
    var path = [], cur = id;
    while (cur !== -1) { path.unshift(cur); cur = N.parent[cur]; }
    var onPath = {};
    path.forEach(function (p) { onPath[p] = true; });
    Array.prototype.forEach.call(document.querySelectorAll("#tv-canvas .tv-node"), function (g) {
      g.classList.toggle("tv-selected", Number(g.getAttribute("data-node-id")) === id);
    });
    Array.prototype.forEach.call(document.querySelectorAll("#tv-canvas .tv-edge"), function (e) {
      e.classList.toggle("tv-path", onPath[Number(e.getAttribute("data-child"))] === true);
    });

    clear(detail);
    var kind = id === 0 ? "root (the prompt)" : N.reward[id] !== null ? "leaf" :
      (N.mixed_anchor[id] ? "mixed anchor" : "inner node");
    detail.appendChild(make("h3", null, "Node " + id + " · " + kind));
    var crumbs = make("div", "tv-crumbs");
    crumbs.appendChild(document.createTextNode("path: "));
    path.forEach(function (p) {
      var button = make("button", null, String(p));
      button.type = "button";
      button.addEventListener("click", function () { selectNode(p); });
      crumbs.appendChild(button);
    });
    detail.appendChild(crumbs);
    var stats = make("dl", "tv-stats");
    [["depth", N.depth[id]],
     ["reward", N.reward[id] !== null ? fmt(N.reward[id], 2) : "— (not a finished leaf)"],
     ["backed-up value V̂", fmt(N.value[id]) + (N.leaves[id] ? "" : " (no finished leaf below)")],
     ["leaves below", N.leaves[id]],
     ["predicted (Ṽψ)", fmt(N.predicted[id]) + (N.stage2_value[id] !== null ? " · Stage 2 allocated with " +
        fmt(N.stage2_value[id]) + " (updated on the bare rollouts)" : "")],
     ["budget received", N.budget[id] + (id === 0 ? " rollouts (Stage 1)" : N.budget[id] === 1 ? " continuation (Stage 2)" :
        N.budget[id] ? " continuations (Stage 2)" : "")],
     ["children", (N.parent.filter(function (p) { return p === id; })).length],
     ["tokens", N.tokens[id] + " (" + N.trained_tokens[id] + " trained)"]].forEach(function (row) {
      stats.appendChild(make("dt", null, row[0]));
      stats.appendChild(make("dd", null, row[1]));
    });
    detail.appendChild(stats);
    if (id === 0) {
      section(detail, "Prompt", tree.prompt);
    } else {
      section(detail, "Thought", N.thought[id]);
      section(detail, "Action", N.action[id]);
      section(detail, "Observation", N.observation[id]);
    }
    if (N.info[id]) section(detail, "Info", N.info[id]);
  }

  $("tv-canvas").addEventListener("click", function (event) {
    var g = event.target.closest ? event.target.closest(".tv-node") : null;
    if (g) selectNode(Number(g.getAttribute("data-node-id")));
  });
  $("tv-canvas").addEventListener("keydown", function (event) {
    var g = event.target.closest ? event.target.closest(".tv-node") : null;
    if (g && (event.key === "Enter" || event.key === " ")) {
      event.preventDefault();
      selectNode(Number(g.getAttribute("data-node-id")));
    }
  });
  function lastStep() { var r = currentRun(); return r ? Math.max(r.steps.length - 1, 0) : 0; }
  $("tv-run").addEventListener("change", function () {
    state.run = Number(this.value); state.step = lastStep(); state.tree = 0;
    fillSteps(); fillTrees(); showStep(); showTree();
  });
  $("tv-step").addEventListener("change", function () {
    state.step = Number(this.value); state.tree = 0;
    fillTrees(); showStep(); showTree();
  });
  $("tv-tree").addEventListener("change", function () {
    state.tree = Number(this.value);
    showTree();
  });

  state.step = lastStep();
  fillRuns(); fillSteps(); fillTrees(); showStep(); showTree();
})();
"""
