"""Every figure computed over a batch of rollout trees, under the one name the trainer, the
benchmark and the report all use.

- `tree/*` (`tree_metrics`): where the budget went and how much of it can teach (DESIGN §2 Metrics).
- verl-style rollout figures (`rollout_metrics`): `critic/score/mean`, `response_length/mean`,
  `num_turns/mean`.
- `predictor/*` (`predictor_metrics`): how well the estimates the allocator acted on matched what the
  rollouts it then started showed.
- `DEFINITIONS` (`definition`): every name a run logs in its `metrics.jsonl`, these and the trainer's
  own (`actor/*`, `rollout/*`, `timing_s/*`, `stage2/*`, ...), with a one-line definition.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_rl.core.tree import RolloutTree, subtree_rewards
from trace_rl.predictor.base import brier_score, expected_calibration_error

FIGURES = ("effective_ratio", "effective_per_candidate", "mixed_budget_share", "anchor_mixed_ratio")
"""The `tree/*` figures tables lead with, reported together because each alone can flatter: filtering
prompts raises effective_ratio while effective_per_candidate falls; mixed_budget_share says where the
budget went."""


def effective_ratio(trees: Sequence[RolloutTree]) -> float:
    """Share of prompts that got rollouts whose leaves are mixed (Knapsack-RL's effective prompt ratio)."""
    sampled = [t for t in trees if t.leaves().size]
    return float(np.mean([t.is_mixed() for t in sampled])) if sampled else 0.0


def anchor_mixed_ratio(trees: Sequence[RolloutTree]) -> float:
    """Share of anchors (nodes with ≥2 children, roots included) whose descendant leaves are mixed."""
    mixed, total = 0, 0
    for tree in trees:
        anchors = tree.anchors()
        if anchors.size:
            mixed += int(subtree_rewards(tree).mixed[anchors].sum())
            total += anchors.size
    return mixed / total if total else 0.0


def mixed_budget_share(trees: Sequence[RolloutTree]) -> float:
    """Share of all leaves (the budget) that belong to a prompt whose leaves are mixed.

    A mixed anchor lies inside a mixed prompt, so this is also the share of rollouts that sit in a
    mixed group or anchor: the part of the budget that can yield a non-zero GRPO-style gradient
    (Knapsack-RL's effective gradient ratio).
    """
    leaves = np.array([t.leaves().size for t in trees], dtype=np.int64)
    mixed = np.array([t.is_mixed() for t in trees], dtype=bool)
    total = int(leaves.sum())
    return float(leaves[mixed].sum() / total) if total else 0.0


def agreeing_budget(trees: Sequence[RolloutTree]) -> tuple[float, float, int]:
    """Where the budget that cannot teach went: the share of all leaves in prompts whose leaves all
    failed (reward 0), the share in prompts whose leaves all got one positive reward (all succeeded;
    the two and `mixed_budget_share` sum to 1), and the most leaves any prompt got without mixing. An allocator that keeps betting on a prompt it
    cannot rescue shows here as a prompt that is 0 for 12; uniform sampling's largest is its group size.
    """
    failed = solved = most = total = 0
    for tree in trees:
        rewards = tree.leaf_rewards()
        total += rewards.size
        if rewards.size and rewards.max() == rewards.min():  # not mixed (`RolloutTree.is_mixed`)
            most = max(most, int(rewards.size))
            if rewards.max() > 0:
                solved += int(rewards.size)
            else:
                failed += int(rewards.size)
    return (failed / total, solved / total, most) if total else (0.0, 0.0, 0)


def generated_tokens(tree: RolloutTree) -> int:
    """Tokens the policy wrote in a tree (every turn's mask ones; the root holds the prompt)."""
    return sum(sum(node.mask) for node in tree.nodes[1:])


def tree_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """The `tree/*` metrics of one batch. The `_per_ktoken` figures divide by the policy tokens the
    batch generated, what a step pays for on a GPU (`rollout.budget_unit: tokens` spends those)."""
    leaves = np.array([t.leaves().size for t in trees], dtype=np.float64)
    sampled = leaves > 0
    branch_depths = [t.nodes[a].depth for t in trees for a in t.anchors() if a != 0]
    mixed = np.array([t.is_mixed() for t in trees], dtype=bool)
    kilotokens = sum(generated_tokens(t) for t in trees) / 1000.0
    failed, solved, most_unmixed = agreeing_budget(trees)
    return {
        "tree/effective_ratio": effective_ratio(trees),
        "tree/effective_per_candidate": float(mixed.mean()) if len(trees) else 0.0,
        "tree/mixed_budget_share": mixed_budget_share(trees),
        "tree/failed_budget_share": failed,
        "tree/solved_budget_share": solved,
        "tree/most_leaves_unmixed": float(most_unmixed),
        "tree/anchor_mixed_ratio": anchor_mixed_ratio(trees),
        "tree/leaves_per_prompt": float(leaves[sampled].mean()) if sampled.any() else 0.0,
        "tree/prompts_sampled": float(sampled.sum()),
        "tree/leaves": float(leaves.sum()),
        "tree/branch_depth/mean": float(np.mean(branch_depths)) if branch_depths else 0.0,
        "tree/branch_points": float(len(branch_depths)),
        "tree/tokens_generated": 1000.0 * kilotokens,
        "tree/mixed_leaves_per_ktoken": float(leaves[mixed].sum() / kilotokens) if kilotokens else 0.0,
        "tree/mixed_prompts_per_ktoken": float(mixed.sum() / kilotokens) if kilotokens else 0.0,
    }


def rollout_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """verl-style figures over every rollout (root-to-leaf path) of the batch."""
    rewards, lengths, turns = [], [], []
    for tree in trees:
        for leaf in tree.leaves():
            path = tree.path(int(leaf))
            rewards.append(tree.nodes[int(leaf)].reward)
            lengths.append(sum(sum(tree.nodes[i].mask) for i in path))
            turns.append(tree.nodes[int(leaf)].depth)
    if not rewards:
        return {}
    return {
        "critic/score/mean": float(np.mean(rewards)),
        "response_length/mean": float(np.mean(lengths)),
        "num_turns/mean": float(np.mean(turns)),
        **tool_metrics(trees),
    }


UNSOLVED_AFTER = 12
"""Earlier rollouts, all failed, after which a prompt counts as unsolved in `rollout/unsolved_share`:
0 for 12 puts its success rate below 22% at 95% confidence (1 - 0.05^(1/12))."""


class UnsolvedTally:
    """Each prompt's rollouts and rewarded rollouts (reward > 0) so far in a run, and the share of a
    step's rollouts spent on prompts none of whose at least `after` rollouts earned a reward (`rollout/unsolved_share`):
    budget an allocator gave to what the run had already shown unsolved. The trainer keeps one
    (`trace_rl.predictor.baselines.ReferencePredictors`); `scripts/results.py trees` rebuilds it from a
    run's saved trees, for runs made before the trainer logged it."""

    def __init__(self, after: float = UNSOLVED_AFTER) -> None:
        self.after = float(after)
        self.trials: dict[str, float] = {}
        self.successes: dict[str, float] = {}

    def share(self, trees: Sequence[RolloutTree]) -> float:
        """Of the leaves of `trees` (one step, before `add`), the share on prompts unsolved so far."""
        leaves = [len(t.leaves()) for t in trees]
        total = sum(leaves)
        spent = sum(n for t, n in zip(trees, leaves) if self.trials.get(t.task_id, 0.0) >= self.after and self.successes.get(t.task_id, 0.0) <= 0.0)
        return spent / total if total else 0.0

    def add(self, trees: Sequence[RolloutTree]) -> None:
        for tree in trees:
            rewards = tree.leaf_rewards()
            self.trials[tree.task_id] = self.trials.get(tree.task_id, 0.0) + float(rewards.size)
            self.successes[tree.task_id] = self.successes.get(tree.task_id, 0.0) + float((rewards > 0).sum())

    def state_dict(self) -> dict[str, Any]:
        return {"after": self.after, "trials": dict(self.trials), "successes": dict(self.successes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.after = float(state["after"])
        self.trials = {k: float(v) for k, v in state["trials"].items()}
        self.successes = {k: float(v) for k, v in state["successes"].items()}


UNAVAILABLE = ("unavailable", "timeout")
"""Tool error kinds on the tool's side (a server down, refusing or too slow), not the model's call."""


def tool_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """Over every tool call the batch made (each turn whose call ran a tool, once however many rollouts
    share it): `tool/calls`, `tool/error_rate` (any failure, a model's bad arguments included) and
    `tool/unavailable_rate` (the tool's side: `UNAVAILABLE`). A server that dies mid-run shows as
    `tool/unavailable_rate` jumping to 1. Empty when no tool ran."""
    calls = errors = unavailable = 0
    for tree in trees:
        for node in tree.nodes:
            info = node.info or {}
            if info.get("call") is None or info.get("answer") is not None or info.get("truncated"):
                continue  # a malformed turn, an answer, or a last turn whose tool never ran
            kind = info.get("tool_error")
            calls += 1
            errors += kind is not None
            unavailable += kind in UNAVAILABLE
    if not calls:
        return {}
    return {"tool/calls": float(calls), "tool/error_rate": errors / calls, "tool/unavailable_rate": unavailable / calls}


def scored_estimates(trees: Sequence[RolloutTree], *, census: bool = False) -> list[tuple[int, int, float]]:
    """(tree index, node id, outcome) triples: which estimate is judged against which 0/1 outcome.

    - `census=False`, the allocator's bets: every rollout against the node it started at (a root for
      a bare rollout, a prefix for a continuation). The estimate was made before the rollout started;
      but Stage 2 starts continuations where it rates failed rollouts' prefixes highest, so these
      pairs over-sample the prefixes the predictor is most optimistic about.
    - `census=True`, the outcomes the predictor is about to learn from (its natural backup targets,
      DESIGN.md): every node with an estimate against each rollout through it that started at it or
      above (the bare rollout through a prefix included: the estimate never saw its outcome). No
      choice of the allocator picks which estimates are judged.

    Nodes without an estimate (`predicted` None) are left out.
    """
    scored = []
    for index, tree in enumerate(trees):
        for leaf in tree.leaves():
            node = tree.nodes[int(leaf)]
            if census:
                path = tree.path(int(leaf))
                judged = path[path.index(node.rollout_start) : -1]
            else:
                judged = [node.rollout_start]
            scored += [(index, n, float(node.reward)) for n in judged if tree.nodes[n].predicted is not None]
    return scored


def allocator_outcomes(
    trees: Sequence[RolloutTree], *, census: bool = False, with_trees: bool = False
) -> tuple[np.ndarray, ...]:
    """(estimate, outcome) arrays of `scored_estimates`, and with `with_trees` the tree index of each."""
    scored = scored_estimates(trees, census=census)
    predicted = [trees[index].nodes[node].predicted for index, node, _ in scored]
    arrays = np.array(predicted, dtype=np.float64), np.array([y for *_, y in scored], dtype=np.float64)
    return (*arrays, np.array([index for index, *_ in scored], dtype=np.int64)) if with_trees else arrays


def brier_standard_error(p: np.ndarray, y: np.ndarray, clusters: np.ndarray) -> float | None:
    """Standard error of a Brier score (the mean of (p - y)²) over pairs that come in `clusters`
    (one per prompt: its rollouts share the prompt and their prefixes, so they are not independent);
    None with fewer than two clusters. The cluster-robust variance of a mean, with the G / (G - 1)
    small-sample factor: a step's Brier is a mean over ~64 rollouts of ~30 prompts, and whether one
    above 0.25 is a broken predictor or a noisy step is read against this."""
    groups, index = np.unique(clusters, return_inverse=True)
    if groups.size < 2:
        return None
    errors = (np.asarray(p, dtype=np.float64) - np.asarray(y, dtype=np.float64)) ** 2
    residual_sums = np.bincount(index, weights=errors - errors.mean(), minlength=groups.size)
    variance = groups.size / (groups.size - 1) * np.sum(residual_sums**2) / errors.size**2
    return float(np.sqrt(variance))


def predictor_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """`predictor/brier` (with its standard error over prompts, `predictor/brier_se`) and
    `predictor/ece` of the allocator's estimates against the outcomes of the rollouts started where
    they were made, and `predictor/brier_census` over every estimate against
    the outcomes it is about to learn from (`scored_estimates`); {} when no rollout had an estimate.

    A constant 0.5 scores a Brier of 0.25: a predictor above that is worse than no predictor.
    """
    p, y, tree_of = allocator_outcomes(trees, with_trees=True)
    if not p.size:
        return {}
    census_p, census_y = allocator_outcomes(trees, census=True)
    se = brier_standard_error(p, y, tree_of)
    return {
        "predictor/brier": brier_score(p, y),
        **({"predictor/brier_se": se} if se is not None else {}),
        "predictor/ece": expected_calibration_error(p, y),
        "predictor/rollouts_scored": float(p.size),
        "predictor/brier_census": brier_score(census_p, census_y),
        "predictor/census_pairs": float(census_p.size),
    }


# ---------------------------------------------------------------- every logged name, defined

FAMILIES: dict[str, str] = {
    "": "Bookkeeping: which record this is.",
    "tree": "Where the batch's budget went and how much of it can teach (`tree_metrics`, `advantage_metrics`).",
    "critic": "verl-style rollout figures (`rollout_metrics`).",
    "response_length": "verl-style rollout figures (`rollout_metrics`).",
    "num_turns": "verl-style rollout figures (`rollout_metrics`).",
    "tool": "Tool calls (`tool_metrics`); only in a step whose rollouts ran a tool.",
    "rollout": ("Counters of the step's sampling (`TreeRolloutCollector.collect`, the planner, the trainer). Under DAPO "
                "resampling the collector's `rollout/*` and `timing_s/*` figures are summed over its rounds."),
    "timing_s": "Wall-clock seconds of the step's phases.",
    "actor": "The policy update (`Trainer._update_policy`).",
    "predictor": ("The success predictor: how its estimates matched the outcomes (`predictor_metrics`, the reference "
                  "predictors), and what its own update reports (which keys depends on the method's predictor)."),
    "brace": "BRACE's per-prompt bank (`rollout.method=brace`).",
    "stage2": "Stage 2's evidence model (methods with TRACE's Stage 2), scored on the batch's continuations before it refits.",
    "val": "Held-out evaluation (`held_out_accuracy`): steps that evaluate, and a comparison's step-0 record.",
}
"""Each family of `DEFINITIONS` (the name before its first `/`; "" for names without one) -> what it covers."""

DEFINITIONS: dict[str, str] = {
    # bookkeeping
    "step": "Training steps done when the record was written (0: before the first update, an evaluation of the starting policy).",
    "method": "The run's `rollout.method` (a string).",
    # tree/*: tree_metrics, advantage_metrics
    "tree/effective_ratio": "Share of sampled prompts (trees with ≥1 leaf) whose leaves are mixed (Knapsack-RL's effective prompt ratio).",
    "tree/effective_per_candidate": "Share of all candidate prompts of the step, sampled or not, whose leaves are mixed.",
    "tree/mixed_budget_share": "Share of the step's leaves that belong to a prompt whose leaves are mixed (Knapsack-RL's effective gradient ratio).",
    "tree/failed_budget_share": "Share of the step's leaves that belong to a prompt whose leaves all got reward 0.",
    "tree/solved_budget_share": "Share of the step's leaves that belong to a prompt whose leaves all got the same positive reward.",
    "tree/most_leaves_unmixed": "Largest number of leaves any one prompt got without its leaves mixing.",
    "tree/anchor_mixed_ratio": "Share of anchors (nodes with ≥2 children, roots included) whose descendant leaves are mixed.",
    "tree/leaves_per_prompt": "Mean number of leaves over the sampled prompts.",
    "tree/prompts_sampled": "Number of prompts that got at least one rollout.",
    "tree/leaves": "Number of leaves (finished rollouts) over all the step's trees.",
    "tree/branch_depth/mean": "Mean depth (turns from the root) of the non-root anchors, where continuations branched off.",
    "tree/branch_points": "Number of non-root anchors (prefixes that got ≥2 children).",
    "tree/tokens_generated": "Policy tokens in the step's trees, each shared turn counted once.",
    "tree/mixed_leaves_per_ktoken": "Leaves of mixed prompts per 1,000 generated policy tokens (`tree/tokens_generated`).",
    "tree/mixed_prompts_per_ktoken": "Mixed prompts per 1,000 generated policy tokens (`tree/tokens_generated`).",
    "tree/nonzero_adv_token_share": "Share of trained policy tokens, each counted by its loss weight, whose advantage is not zero.",
    # verl-style rollout figures
    "critic/score/mean": "Mean over the step's rollouts (root-to-leaf paths) of the leaf's reward.",
    "response_length/mean": "Mean over the step's rollouts of the policy tokens on the path (a shared prefix counted in each rollout).",
    "num_turns/mean": "Mean over the step's rollouts of the leaf's depth (turns).",
    # tool/*
    "tool/calls": "Tool calls the step's turns ran, each turn once however many rollouts share it.",
    "tool/error_rate": "Share of those tool calls that failed for any reason (a model's bad arguments included).",
    "tool/unavailable_rate": "Share of those tool calls that failed on the tool's side (`UNAVAILABLE`: unavailable, timeout).",
    # rollout/*
    "rollout/budget": "The step's rollout budget in its unit (leaves, or expected tokens with `rollout.budget_unit: tokens`).",
    "rollout/stage1_budget": "The part of `rollout/budget` Stage 1 spends on bare rollouts from prompts.",
    "rollout/stage2_budget": "The part of `rollout/budget` left to Stage 2 (continuations from prefixes).",
    "rollout/stage2_to_roots": "Stage 2 rollouts that started at a root (a fresh rollout of a prompt) rather than at a prefix.",
    "rollout/leaves": "Rollouts (leaves) the step sampled, all DAPO rounds included.",
    "rollout/tokens_generated": "Tokens the engine generated for the step (every sampled completion).",
    "rollout/tokens_observation": "Tool-observation tokens appended to the step's contexts.",
    "rollout/tokens_prefill": "Context tokens the engine had to prefill (each call's context less its cached tokens).",
    "rollout/tokens_prompt": "Prompt tokens of the prompts that were allocated rollouts (root budget > 0).",
    "rollout/tokens_planned": "Expected tokens the planner's requests spend (token budgets only).",
    "rollout/unsolved_share": "Share of the step's rollouts spent on prompts that had failed every one of at least 12 earlier rollouts in the run (`UNSOLVED_AFTER`): budget given to what the run had shown unsolved.",
    "rollout/weight_version": "The policy version (updates done) the step's rollouts were sampled from.",
    "rollout/engine_freed_mb": "Memory the engine freed before the update (its prefix cache and weight copy, stale once the update runs), MiB.",
    "rollout/weight_push_bytes": "Bytes of weights pushed to the Ray rollout workers for the step (`rollout.backend=ray`).",
    "rollout/dapo_kept_prompts": "Prompts DAPO kept for the update (mixed groups, at most `prompts_per_step`).",
    "rollout/rollouts_total": "Rollouts (`rollout/leaves`) summed over the run so far.",
    "rollout/tokens_total": "Generated tokens (`rollout/tokens_generated`) summed over the run so far.",
    # timing_s/*
    "timing_s/gen": "Seconds in engine generate calls.",
    "timing_s/env": "Seconds in environment steps (tool calls, scoring).",
    "timing_s/alloc": "Seconds the planner spent choosing Stage 1's and Stage 2's requests.",
    "timing_s/weight_push": "Seconds pushing weights to the Ray rollout workers (`rollout.backend=ray`).",
    "timing_s/update": "Seconds of the policy update (advantages, loss epochs, weight sync to the engine).",
    "timing_s/predictor": "Seconds of the predictor's (and reference predictors') update.",
    "timing_s/step": "Seconds of the whole training step, evaluation excluded.",
    "timing_s/allocation_overhead_share": "(`timing_s/alloc` + `timing_s/predictor`) / `timing_s/step`: the share of the step TRACE's machinery cost.",
    "timing_s/eval": "Seconds of the held-out evaluation.",
    "timing_s/trace_collect": "Seconds TRACE's rollout manager took for the step (verl integration).",
    # actor/*
    "actor/pg_loss": "Policy-gradient loss, mean over the step's optimiser steps (mini-batches × epochs).",
    "actor/clipfrac": "Weighted share of the mini-batch's loss tokens where the clipped term was taken, mean over the optimiser steps.",
    "actor/kl": "KL penalty estimate to the reference policy (k3), weighted token mean, mean over the optimiser steps (0 without one).",
    "actor/ratio_mean": "Mean importance ratio π/π_old over the tokens in the loss, mean over the optimiser steps (1.0 when none).",
    "actor/grad_norm": "Gradient norm before clipping, mean over the optimiser steps.",
    "actor/sequences": "Training sequences the step's trees gave the update.",
    "actor/tokens_forward": "Tokens through the model's forward passes over all epochs (padding excluded, packed rows whole).",
    "actor/rollout_logprob_gap": "Mean |engine log-prob − recomputed log-prob| over trained tokens (`recompute_log_prob` only).",
    # predictor/*: predictor_metrics
    "predictor/brier": "Brier score of the allocator's estimates, each rollout against the estimate of the node it started at.",
    "predictor/brier_se": "Standard error of `predictor/brier`, cluster-robust over prompts.",
    "predictor/ece": "Expected calibration error (10 equal-width bins) of the same estimate/outcome pairs as `predictor/brier`.",
    "predictor/rollouts_scored": "Rollouts scored in `predictor/brier` (those that started at a node with an estimate).",
    "predictor/brier_census": "Brier score of every estimate on a rollout's path, from where it started, against its outcome.",
    "predictor/census_pairs": "Estimate/outcome pairs scored in `predictor/brier_census`.",
    # predictor/*: the reference predictors (trace_rl.predictor.baselines)
    "predictor/brier_constant": "Brier score on `predictor/brier`'s pairs of a constant: the mean reward of every earlier step's rollouts (0.5 at first).",
    "predictor/brier_history": "Brier score on `predictor/brier`'s pairs of the per-prompt history predictor.",
    "predictor/brier_constant_census": "`predictor/brier_constant` on `predictor/brier_census`'s pairs.",
    "predictor/brier_history_census": "`predictor/brier_history` on `predictor/brier_census`'s pairs.",
    # predictor/*: the predictor's own update
    "predictor/loss": "Weighted cross-entropy of the predictor's estimates before its update on the step's backup targets (out of sample).",
    "predictor/loss_after": "The same cross-entropy after the update.",
    "predictor/examples": "Backup-target examples (nodes) the predictor's update got.",
    "predictor/replayed": "Root examples of earlier steps the update trained on again.",
    "predictor/step_capped": "Share of the update's minibatch steps that `max_logit_step` scaled down.",
    "predictor/<head>calibration_slope": "Slope of the head's fitted calibration; `<head>` is empty for the prefix head, `root_` for the root head.",
    "predictor/<head>calibration_intercept": "Intercept of the head's fitted calibration (`<head>`: empty for prefixes, `root_` for roots).",
    "predictor/<head>calibrated": "1 while the head answers calibrated, else 0 (`<head>`: empty for prefixes, `root_` for roots).",
    "predictor/examples_used": "Root examples (prompts) a per-prompt history predictor (prompt_only, knapsack, brace) counted.",
    "predictor/guard_shrink": "λ of the guarded predictor after the update: estimates are scaled to 0.5 + λ(p − 0.5).",
    "predictor/guard_brier": "Weighted Brier score of the inner predictor's estimates on the step's examples, before its update.",
    "predictor/guard_brier_half": "Weighted Brier score of a constant 0.5 on the same examples.",
    "predictor/guard_gain": "Brier of 0.5 minus Brier of the scaled estimates, weighted over the guard's window of batches.",
    # brace/*
    "brace/correlation": "Fitted correlation ρ = 1 / (1 + ν) of rollouts within a prompt's group (ν: the Beta-Binomial concentration; 0: independent draws).",
    "brace/groups_seen": "Rollout groups (≥2 rollouts of a prompt) kept to fit `brace/correlation`.",
    # stage2/*
    "stage2/brier_predictor": "Brier score of the predictor's estimate ṽ at each continuation's starting prefix against its outcome.",
    "stage2/brier_evidence": "Brier score of the posterior (ṽ with the prefix's bare outcomes) at the current fit, on the same continuations.",
    "stage2/continuations": "Continuations scored in the two Brier figures.",
    "stage2/correlation": "Fitted correlation ρ = 1 / (1 + ν) of a prefix's continuations (0: independent draws, the paper's model).",
    "stage2/own_weight": "Share of a first-turn prefix's posterior its bare outcome carries, 1 / (κ + 1) (0: the paper's value).",
    "stage2/prompt_weight": "Fitted weight w of the prompt's other rollouts in a prefix's posterior (0 before the fit).",
    # val/*
    "val/accuracy_greedy": "Mean over held-out tasks of the reward of one greedy rollout.",
    "val/accuracy_sampled": "Mean over held-out tasks of the mean reward of `train.eval_samples` sampled rollouts.",
    "val/accuracy_sampled_se": "Standard error of `val/accuracy_sampled` from sampling noise on these tasks.",
    "val/accuracy_sampled_se_tasks": "Standard error of `val/accuracy_sampled` from the spread over tasks (std / √tasks).",
}
"""Every name a run can log in its `metrics.jsonl` (and TensorBoard, W&B) -> a one-line definition.
A `<name>` part matches any run of letters, digits and underscores, empty included (`definition`)."""


def family(key: str) -> str:
    """The family of a metric name: the part before its first `/` ("" for a name without one)."""
    return key.split("/", 1)[0] if "/" in key else ""


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("".join(r"[A-Za-z0-9_]*" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]*>)", key)))


def definition(key: str) -> str | None:
    """The definition of a logged metric name: its exact entry in `DEFINITIONS`, else the first pattern
    entry it matches; None for a name that has none."""
    if key in DEFINITIONS:
        return DEFINITIONS[key]
    return next((text for name, text in DEFINITIONS.items() if "<" in name and _pattern(name).fullmatch(key)), None)
