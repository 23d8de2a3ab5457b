"""Progress reporting of long commands."""


def test_progress_off_a_terminal_is_plain_lines_with_rate_and_eta():
    import io

    from rich.progress import Progress

    from trace_rl.infra.progress import Bars

    log = io.StringIO()
    with Progress(disable=True) as progress:
        bars = Bars(progress, log=log, log_every_s=0.0)
        task = bars.task("warm start", total=4)
        for step in range(1, 5):
            bars.update(task, step, {"loss": 1.0 / step})
    lines = log.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("warm start: 1/4 ") and "/s" in lines[0] and "eta" in lines[0]
    assert lines[-1].startswith("warm start: 4/4 ") and " done " in lines[-1] and "loss=0.25" in lines[-1]


def test_a_log_line_right_after_a_task_starts_states_no_rate_or_eta():
    import io

    from rich.progress import Progress

    from trace_rl.infra.progress import Bars

    log = io.StringIO()
    with Progress(disable=True) as progress:
        bars = Bars(progress, log=log, log_every_s=0.0)
        task = bars.task("warm start", total=1200)
        bars.update(task, 1, {"loss": 7.35})
    assert log.getvalue().startswith("warm start: 1/1200  ?/s  elapsed 0:00  eta ?  loss=7.35")


def test_a_resumed_warm_start_counts_its_rate_from_the_step_it_resumed_at():
    import io

    from rich.progress import Progress

    from trace_rl.infra.progress import Bars, warm_start_progress

    log = io.StringIO()
    with Progress(disable=True) as progress:
        bars = Bars(progress, log=log, log_every_s=0.0)
        on_step = warm_start_progress(bars, total=1200)
        on_step(600, 0.5)  # the first step after a resume at 600
        (state,) = bars._tasks.values()
        assert state["first"] == 600  # the 600 steps before are not counted in this process's rate
    assert log.getvalue().startswith("warm start: 601/1200  ?/s")
    warm_start_progress(None, total=1200)(0, 1.0)  # no bars: nothing to report, no error


def test_a_progress_line_names_a_comparison_run_by_its_row_not_its_method() -> None:
    from pathlib import Path

    from trace_rl.run import run_label

    # a variant of `trace` (tokens_paper's trace_tokens) read "seed_1 trace", like trace's own runs
    assert run_label(Path("runs/tokens_paper/trace_tokens/seed_1"), "trace") == "trace_tokens seed_1"
    assert run_label(Path("runs/demo"), "trace") == "demo trace"


def test_a_long_phase_inside_a_step_is_said_beside_the_bar_and_in_the_log(tmp_path):
    import io

    from rich.progress import Progress
    from test_train import scripted_parts, small_config

    from trace_rl.infra.progress import Bars
    from trace_rl.run import build_trainer

    log = io.StringIO()
    with Progress(disable=True) as progress:
        bars = Bars(progress, log=log, log_every_s=0.0)
        task = bars.task("trace seed_0", total=2)
        bars.note(task, "evaluation: 40/800 rollouts")
    assert log.getvalue().startswith("trace seed_0: 0/2 ") and log.getvalue().rstrip().endswith("evaluation: 40/800 rollouts")

    config = small_config(steps=1, eval_every=1, eval_samples=2)
    trainer = build_trainer(config, scripted_parts(config, tmp_path / "cache"), tmp_path / "run")
    phases: list[str] = []
    trainer.run(on_phase=phases.append)
    assert phases[:2] == ["step 1: rollouts", "step 1: update"]
    evaluation = [p for p in phases if p.startswith("evaluation")]
    assert evaluation and evaluation[-1] == f"evaluation: {3 * len(trainer.setup.test_tasks)}/{3 * len(trainer.setup.test_tasks)} rollouts"
