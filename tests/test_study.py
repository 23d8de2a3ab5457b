"""trace_rl.research.study: a plan's folders read as one, its contrasts paired by seed, its wall-clock without pauses."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from repo_files import load
from study_runs import T0, write_run, write_study

from trace_rl.report.plots import curve, load_run
from trace_rl.research.stage2_probe import PROBE_COLUMNS
from trace_rl.research.study import (
    PROBE_FILE,
    STRONGEST,
    clock,
    net_times,
    paired,
    read_pauses,
    sign_test,
    strongest_baseline,
    study,
    study_markdown,
)


def brute_sign_p(wins: int, losses: int) -> float:
    """The two-sided sign test by enumerating every sign pattern: the share at least as uneven."""
    n = wins + losses
    seen = abs(wins - n / 2)
    patterns = list(itertools.product((0, 1), repeat=n))
    return sum(abs(sum(p) - n / 2) >= seen - 1e-12 for p in patterns) / len(patterns) if n else 1.0


@pytest.mark.parametrize("wins, losses", [(0, 0), (1, 0), (3, 0), (2, 1), (7, 1), (8, 0), (4, 4), (1, 6), (5, 2)])
def test_sign_test_matches_the_enumeration_of_sign_patterns(wins: int, losses: int) -> None:
    differences = [0.01] * wins + [-0.02] * losses + [0.0, math.nan]  # a tie and a missing seed count for nothing
    assert sign_test(differences) == pytest.approx(brute_sign_p(wins, losses), abs=1e-12)


def test_sign_test_by_hand() -> None:
    assert sign_test([0.1] * 7 + [-0.1]) == pytest.approx(2 * 9 / 256)  # 7 of 8: 2 (C(8,0) + C(8,1)) / 2^8
    assert sign_test([0.1] * 8) == pytest.approx(2 / 256)
    assert sign_test([]) == 1.0


def test_paired_differences_a_hand_worked_case() -> None:
    a = {0: 0.30, 1: 0.20, 2: 0.25}
    b = {0: 0.20, 1: 0.20, 2: 0.15, 3: 0.90}  # seed 3 has no pair
    c = paired(a, b)
    # differences 0.1, 0, 0.1: mean 1/15, sd sqrt(1/300), t(2) = 4.303
    assert c["seeds"] == 3 and c["mean"] == pytest.approx(1 / 15)
    assert c["ci95"] == pytest.approx(4.303 * math.sqrt(1 / 300) / math.sqrt(3))
    assert (c["low"], c["high"]) == pytest.approx((1 / 15 - c["ci95"], 1 / 15 + c["ci95"]))
    assert (c["wins"], c["losses"], c["ties"]) == (2, 0, 1) and c["sign_p"] == pytest.approx(0.5)
    assert c["per_seed"] == pytest.approx({"0": 0.1, "1": 0.0, "2": 0.1})
    one = paired({0: 0.3}, {0: 0.1})
    assert one["seeds"] == 1 and math.isnan(one["ci95"])


def test_strongest_baseline_is_the_best_mean_ties_to_the_earlier_row_and_waits_for_every_seed() -> None:
    finals = {"grpo": {0: 0.2, 1: 0.3}, "pcl": {0: 0.3, 1: 0.2}, "dapo": {0: 0.1, 1: 0.1}}
    assert strongest_baseline(finals, ["grpo", "pcl", "dapo"], [0, 1])["row"] == "grpo"  # tie at 0.25: the earlier row
    assert strongest_baseline(finals, ["pcl", "grpo", "dapo"], [0, 1])["row"] == "pcl"
    assert strongest_baseline(finals, ["grpo", "dapo"], [0])["row"] == "grpo"
    waiting = strongest_baseline(finals, ["grpo", "pcl", "brace"], [0, 1])
    assert waiting["row"] is None and math.isnan(waiting["means"]["brace"])


def test_read_pauses_pairs_stops_with_conts_and_refuses_a_broken_log(tmp_path: Path) -> None:
    log = tmp_path / "pauses.log"
    log.write_text("# comment\nstop 2027-01-15T08:00Z tests\ncont 2027-01-15T08:02:30Z\n\nstop 2027-01-15T09:00:00Z ci # why\ncont 2027-01-15T09:01Z\n")
    assert read_pauses(log) == [(T0, T0 + 150), (T0 + 3600, T0 + 3660)]
    for bad in ("cont 2027-01-15T08:00Z\n", "stop 2027-01-15T08:00Z\n", "stop 2027-01-15T08:00Z\nstop 2027-01-15T08:01Z\n", "stop 08:00\ncont 08:01\n"):
        log.write_text(bad)
        with pytest.raises(ValueError):
            read_pauses(log)


def test_clock_takes_the_logged_pauses_out_of_the_steps_and_evaluations_they_fell_in(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", {2: 0.5}, steps=3)
    # steps end at T0+10, T0+20 (then an evaluation to T0+120), T0+130
    pauses = [(T0 + 5, T0 + 8), (T0 + 18, T0 + 40), (T0 + 125, T0 + 500)]
    assert clock(run, pauses) == {"1": {"step": 7.0}, "2": {"step": 8.0, "eval": 80.0}, "3": {"step": 5.0}}
    assert clock(run, []) == {"1": {"step": 10.0}, "2": {"step": 10.0, "eval": 100.0}, "3": {"step": 10.0}}


def test_net_times_count_a_time_far_over_its_kinds_median_at_the_median() -> None:
    rows = {0: {"timing_s/eval": 999.0}, 1: {"timing_s/step": 10.0}, 2: {"timing_s/step": 12.0, "timing_s/eval": 50.0},
            3: {"timing_s/step": 500.0}, 4: {"timing_s/step": 11.0, "timing_s/eval": 60.0}}
    times, capped = net_times(rows)
    assert capped == 1 and times == {1: {"step": 10.0}, 2: {"step": 12.0, "eval": 50.0}, 3: {"step": 11.5}, 4: {"step": 11.0, "eval": 60.0}}
    logged = {"3": {"step": 9.0}}  # the pause was logged: its clock wins over the rule
    assert net_times(rows, logged) == ({1: {"step": 10.0}, 2: {"step": 12.0, "eval": 50.0}, 3: {"step": 9.0}, 4: {"step": 11.0, "eval": 60.0}}, 0)


def test_study_joins_phases_by_row_and_seed_and_pairs_the_plans_contrasts(tmp_path: Path) -> None:
    one, two = write_study(tmp_path)
    result = study([one, two], steps=4, reference="grpo", contrasts=["trace:grpo", f"trace:{STRONGEST}"],
                   candidates=["grpo", "pcl"], baseline_seeds=[0, 1], order=["grpo", "pcl", "trace"])
    assert list(result["rows"]) == ["grpo", "pcl", "trace"]
    grpo, trace = result["rows"]["grpo"], result["rows"]["trace"]
    assert grpo["final_per_seed"] == {"0": 0.20, "1": 0.30, "2": 0.30} and trace["final_per_seed"] == {"0": 0.35, "2": 0.40}
    assert result["unfinished"] == {"trace": {"1": 2}}
    assert grpo["gain"]["seeds"] == 2 and grpo["gain"]["mean"] == pytest.approx(0.10)  # against each seed's own start
    assert trace["vs_reference"]["per_seed"] == pytest.approx({"0": 0.15, "2": 0.10})
    assert (grpo["effective_ratio"], grpo["effective_per_candidate"], grpo["budget_could_not_teach"]) == pytest.approx((0.5, 0.25, 0.4))
    assert (grpo["rollouts"], grpo["tokens"]) == (32.0, 200.0)
    assert grpo["minutes"] == pytest.approx((240 + 140 + 140) / 3 / 60)  # 4 steps of 10 s; seed 0 evaluated twice, 1 and 2 once
    assert result["strongest_baseline"]["row"] == "grpo"  # 0.25 each on seeds 0-1: the earlier row
    strongest = result["contrasts"][f"trace:{STRONGEST}"]
    assert strongest["b"] == "grpo" and strongest["per_seed"] == pytest.approx({"0": 0.15, "2": 0.10})
    assert strongest["sign_p"] == pytest.approx(0.5)
    text = study_markdown(result)
    assert "**grpo**" in text and "trace − grpo (trace:@strongest)" in text and "trace seed 1 at step 2" in text


def test_study_joins_the_phases_probes_by_row_and_seed_and_averages_over_all_seeds(tmp_path: Path) -> None:
    one, two = write_study(tmp_path)
    assert "probe" not in study([one, two], steps=4)  # no folder probed: no section
    figures = dict.fromkeys((key for key, _, _ in PROBE_COLUMNS), 0.0)
    (one / PROBE_FILE).write_text(json.dumps({"warmup": 5, "rows": {"trace": {"seeds": {
        "seed_0": figures | {"predicted_mixed": 0.6, "mixed": 0.2, "continuation_mass_share": math.nan},
        "seed_1": figures | {"predicted_mixed": 0.5, "mixed": 0.4}}, "mean": {}}}}))
    (two / PROBE_FILE).write_text(json.dumps({"warmup": 5, "rows": {"trace": {"seeds": {"seed_2": figures | {"predicted_mixed": 0.4, "mixed": 0.3}}}}}))
    probe = study([one, two], steps=4)["probe"]["rows"]["trace"]
    mean = probe["mean"]
    assert len(probe["seeds"]) == 3 and mean["predicted_mixed"] == pytest.approx(0.5) and mean["mixed"] == pytest.approx(0.3)
    assert mean["continuation_mass_share"] == 0.0  # seed 0's NaN (nothing to share) left out, not spread
    (two / PROBE_FILE).write_text(json.dumps({"warmup": 5, "rows": {"trace": {"seeds": {"seed_2": {"predicted_mixed": 0.4}}}}}))
    mean = study([one, two], steps=4)["probe"]["rows"]["trace"]["mean"]
    assert mean["brier"] == 0.0 and mean["predicted_mixed"] == pytest.approx(0.5)  # a figure a seed lacks: the others' mean
    text = study_markdown(study([one, two], steps=4))
    assert "| trace | 3 | 0 | 0.500 | 0.300 |" in text  # the probe's own table (prefixes, predicted, mixed, ...)
    (two / PROBE_FILE).write_text(json.dumps({"warmup": 3, "rows": {"trace": {"seeds": {"seed_2": figures}}}}))
    with pytest.raises(ValueError, match="warmup 3"):
        study([one, two], steps=4)


def test_study_refuses_a_row_and_seed_in_two_folders_and_a_malformed_contrast(tmp_path: Path) -> None:
    one, two = write_study(tmp_path)
    write_run(two / "grpo" / "seed_0", {4: 0.9})
    with pytest.raises(ValueError, match="grpo seed 0 is in two folders"):
        study([one, two], steps=4)
    with pytest.raises(ValueError, match="expected ROW:ROW"):
        study([one], steps=4, contrasts=["trace-grpo"])


def test_study_waits_to_name_the_strongest_baseline_until_every_candidate_has_its_seeds(tmp_path: Path) -> None:
    one, _ = write_study(tmp_path)
    result = study([one], steps=4, contrasts=[f"trace:{STRONGEST}"], candidates=["grpo", "pcl", "brace"], baseline_seeds=[0, 1])
    assert result["strongest_baseline"]["row"] is None and "pending" in result["contrasts"][f"trace:{STRONGEST}"]


def test_curves_by_tokens_and_by_wall_clock_minutes(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", {2: 0.1, 4: 0.3}, tokens=30))
    by_tokens = curve([run], "val/accuracy_sampled", "tokens")
    assert list(by_tokens.x) == [60.0, 120.0]
    by_minutes = curve([run], "val/accuracy_sampled", "minutes")
    assert list(by_minutes.x) == pytest.approx([120 / 60, 240 / 60])  # each evaluation's own time counted before its point


def test_results_script_study_writes_the_table_the_json_and_the_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    one, two = write_study(tmp_path)
    log = tmp_path / "pauses.log"
    log.write_text("stop 2027-01-15T08:00:05Z\ncont 2027-01-15T08:00:08Z\n")  # 3 s out of every run's first step
    results = load("scripts/results.py")
    out = tmp_path / "out"
    assert results.main(["study", str(one), str(two), "--steps", "4", "--reference", "grpo", "--contrast", "trace:grpo",
                         "--pauses", str(log), "--out", str(out)]) == 0
    saved = json.loads((out / "study.json").read_text())
    assert saved["rows"]["grpo"]["minutes"] == pytest.approx((237 + 137 + 137) / 3 / 60)
    assert (out / "study.md").read_text() == study_markdown(saved)
    assert (out / "study_plots" / "accuracy_vs_minutes.png").exists() and (out / "study_plots" / "contrasts.png").exists()


def test_the_contrast_plot_has_a_line_per_row_against_the_reference_and_per_named_contrast(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    from trace_rl.report.plots import plot_contrasts

    one, two = write_study(tmp_path)
    result = study([one, two], steps=4, reference="grpo", contrasts=["trace:pcl"], order=["grpo", "pcl", "trace"])
    assert [row for row, figures in result["rows"].items() if figures.get("vs_reference")] == ["pcl", "trace"]
    path = plot_contrasts(result, tmp_path / "contrasts.png")
    with Image.open(path) as image:  # pcl − grpo, trace − grpo, trace − pcl: 1.1 + 0.3 inches a line, at 110 dpi
        assert image.size == (round(7.6 * 110), round((1.1 + 0.3 * 3) * 110))
    one_seed = study([one], steps=4, reference="grpo", contrasts=["trace:pcl"])  # trace has one finished seed: a dot, no interval
    assert math.isnan(one_seed["contrasts"]["trace:pcl"]["ci95"]) and plot_contrasts(one_seed, tmp_path / "one.png") is not None
    assert plot_contrasts({**result, "rows": {}, "contrasts": {}}, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_an_exported_study_keeps_its_clock_packed_and_reads_the_same_minutes_from_it(tmp_path: Path) -> None:
    """`export --pauses` records each run's clock net of pauses (the copies carry no tree files to redo
    it from), packed with the runs: the study of the exported folder reads the live folder's minutes."""
    pytest.importorskip("matplotlib")
    one, _ = write_study(tmp_path)
    (one / "compare.yaml").write_text("methods: [grpo, pcl, trace]\nseeds: [0, 1]\nrun:\n  train:\n    steps: 4\n")
    log = tmp_path / "pauses.log"
    log.write_text("stop 2027-01-15T08:00:05Z\ncont 2027-01-15T08:00:08Z\n")
    results = load("scripts/results.py")
    dest = tmp_path / "exported"
    results.export(one, dest, one / "compare.yaml", log, plots=False)
    assert not (dest / "clock.json").exists() and results.run_file_exists(dest / "clock.json")
    live = study([one], steps=4, pauses=read_pauses(log))
    copied = study([dest], steps=4)
    assert copied["rows"]["grpo"]["minutes"] == pytest.approx(live["rows"]["grpo"]["minutes"]) == pytest.approx((237 + 137) / 2 / 60)
