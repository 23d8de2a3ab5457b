"""Reports of a run or a comparison: PNG curves, a self-contained HTML tree viewer, and `report.html`.

Needs the `report` extra (matplotlib) for the plots; the viewer needs nothing beyond the core.
"""

from trace_rl.report.html import ReportFiles, build_report, write_report
from trace_rl.report.plots import (
    find_runs,
    load_run,
    plot_metrics,
    plot_path,
    plot_runs,
)
from trace_rl.report.viewer import (
    ViewerLimits,
    viewer_data,
    viewer_page,
    viewer_section,
    write_viewer,
)

__all__ = [
    "ReportFiles",
    "ViewerLimits",
    "build_report",
    "find_runs",
    "load_run",
    "plot_metrics",
    "plot_path",
    "plot_runs",
    "viewer_data",
    "viewer_page",
    "viewer_section",
    "write_report",
    "write_viewer",
]
