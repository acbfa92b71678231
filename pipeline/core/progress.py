"""Progress on long work: a tqdm bar on a terminal, plain lines in logs (no carriage returns).

tqdm is a build dependency (well kept, handles terminals of every kind); logs that are not a
terminal (nox, CI, a worker's log file) get one line per status change instead of redrawn bars.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

# In a log (no terminal), counting progress prints a line at most this often.
LOG_EVERY_S = 10.0


class Progress:
    """Counts ``total`` units of work and shows a status; ``with`` closes it."""

    def __init__(self, total: int, desc: str, unit: str = "item", stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.desc = desc
        self.unit = unit
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self.last_status = ""
        self.last_line = self.started
        self.last_beat = 0.0  # the step's seconds at its last line in a log
        self.bar: Any = None
        if self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is a build dependency
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=False)

    def update(self, count: int = 1) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)
            return
        now = time.monotonic()
        if now - self.last_line >= LOG_EVERY_S:  # a log hears of long counting work too
            self.last_line = now
            print(
                f"  {self.desc}: {self.done} of {self.total} {self.unit}s "
                f"({now - self.started:.0f} s)",
                file=self.stream,
                flush=True,
            )

    def status(self, text: str, seconds: float | None = None) -> None:
        """What is being done now; in a log, printed once per change. With ``seconds`` (how
        long this step has run: a heartbeat the caller sends now and then), printed again once
        it is ``LOG_EVERY_S`` past the last line of that step, so a log hears of a step that
        runs for minutes, but not of every poll (a compile child's, twice a second: 620 lines
        for one validation)."""
        if self.bar is not None:
            shown = text if seconds is None else f"{text} {seconds:.0f} s"
            self.bar.set_postfix_str(shown, refresh=True)
        elif text != self.last_status or (
            seconds is not None and seconds - self.last_beat >= LOG_EVERY_S
        ):
            elapsed = time.monotonic() - self.started
            print(f"  {self.desc}: {text} ({elapsed:.0f} s)", file=self.stream, flush=True)
            self.last_line = time.monotonic()
            self.last_beat = seconds if seconds is not None else 0.0
        self.last_status = text

    def note(self, text: str) -> None:
        """A passing detail (the step now running): on the bar only, never a log line."""
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=True)

    def write(self, text: str) -> None:
        """A finished line of output (stdout), printed above the bar."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
