"""Progress in a log (no terminal): plain lines, one per change, and counting work heard of."""

from __future__ import annotations

import io

import pytest

from pipeline.core import progress as progress_mod
from pipeline.core.progress import Progress


def test_a_log_gets_plain_lines_once_per_status() -> None:
    stream = io.StringIO()
    with Progress(3, "judge", "round", stream=stream) as progress:
        progress.status("round 1")
        progress.status("round 1")
        progress.note("a passing detail")  # the bar's only
        progress.status("round 2")
    lines = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["  judge: round 1", "  judge: round 2"]
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_a_heartbeat_status_prints_each_time() -> None:
    """A status sent with the step's seconds (a probe waiting on a slow simulator, every 30 s)
    is printed each time, though its text is the same."""
    stream = io.StringIO()
    with Progress(3, "judge", "round", stream=stream) as progress:
        progress.status("round 1: 0 of 6 samples run on the HTP", 30.0)
        progress.status("round 1: 0 of 6 samples run on the HTP", 60.0)
    lines = [line.split(" (")[0] for line in stream.getvalue().splitlines()]
    assert lines == ["  judge: round 1: 0 of 6 samples run on the HTP"] * 2


def test_counting_work_prints_a_line_when_enough_time_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every update is "long enough" at 0 s and none is at an hour: no clock is raced."""
    stream = io.StringIO()
    monkeypatch.setattr(progress_mod, "LOG_EVERY_S", 0.0)
    with Progress(4, "calibrate net", "sample", stream=stream) as progress:
        progress.update()
        progress.update(2)
    assert [line.split(" (")[0] for line in stream.getvalue().splitlines()] == [
        "  calibrate net: 1 of 4 samples",
        "  calibrate net: 3 of 4 samples",
    ]
    quiet = io.StringIO()
    monkeypatch.setattr(progress_mod, "LOG_EVERY_S", 3600.0)
    with Progress(4, "calibrate net", "sample", stream=quiet) as progress:
        progress.update(4)
    assert quiet.getvalue() == ""
