"""The one progress-bar layout used by long work (prepare, synth, train epochs, validation, evaluation), and its
plain-line form for output that is not a terminal."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class _QuietWhenDisabled(Progress):
    """rich's `Progress.stop` prints an empty line when its console is not interactive, even for a bar that is
    disabled and never drew anything: off a terminal (CI, SLURM logs, a pipe) every epoch, validation and
    evaluation left a blank line. A disabled bar here prints nothing at all."""

    def stop(self) -> None:
        if not self.disable:
            super().stop()


def progress_bar(description: str = "{task.description}", *extra_columns: ProgressColumn,
                 console: Console | None = None, transient: bool = False, disable: bool = False) -> Progress:
    """description | bar | done/total | elapsed | remaining | extra columns."""
    return _QuietWhenDisabled(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              TimeRemainingColumn(), *extra_columns, console=console, transient=transient,
                              disable=disable)


class ProgressLines:
    """What a bar shows, as plain lines, for output that is not a terminal (SLURM logs, CI, a pipe) and for a
    log file (`log`).

    A rich bar draws nothing there, so an epoch would be silent until it ends. `update` prints one line after
    the first step (training started, and at what speed) and then one whenever `every_s` seconds have passed
    since the last line; the last step prints nothing (the caller's end-of-work line follows).

    `unit` names what is counted ("step" for training; "case" for check and prepare, whose lines also give the
    rate in cases per second).
    """

    def __init__(self, description: str, total: int, *, console: Console | None, every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] | None = None,
                 scope: str = "", rest: tuple[str, int, float] | None = None, unit: str = "step") -> None:
        """`scope` names what "left" counts ("this epoch"); `rest` = (name, steps, seconds) of the work after
        this bar's (the run's later epochs: their steps, at this bar's pace, plus their other known seconds),
        said as a second estimate ("about 0:40:00 in the run")."""
        self.description, self.total, self.console, self.every_s, self._clock = (
            description, total, console, every_s, clock)
        self.scope, self.rest = scope, rest
        self.unit = unit  # "step" (training); "case" (check, prepare: their lines also give the rate)
        self.log = log  # also written here (train.log: `tail -f` shows the epoch moving); None: console only
        self._started = clock()
        self._last_line: float | None = None
        self._first_done: int | None = None

    def update(self, completed: int, info: str = "") -> None:
        now = self._clock()
        if self._first_done is None and completed > 0:
            self._first_done = completed - 1  # a resumed epoch starts part-way
        due = self._last_line is None or now - self._last_line >= self.every_s
        if not due or completed >= self.total:
            return
        self._last_line = now
        elapsed = now - self._started
        done_here = completed - self._first_done if self._first_done is not None else 0
        per_step = elapsed / done_here if done_here else None  # a pool woke up before any case finished
        left = (f"about {_clock_time(per_step * (self.total - completed))} left" if per_step is not None
                else "time left not known yet")
        line = (f"{self.description} {self.unit} {completed}/{self.total}, {_clock_time(elapsed)} elapsed, "
                f"{left}" + (f" in {self.scope}" if self.scope else ""))
        if self.rest is not None and per_step is not None:
            name, steps, seconds = self.rest
            line += f", about {_clock_time(per_step * (self.total - completed + steps) + seconds)} in {name}"
        if self.unit != "step" and elapsed > 0 and done_here:  # no rate before the first unit is done
            line += f"  {done_here / elapsed:.2f} {self.unit}s/s"
        line += f"  {info}" if info else ""
        if self.console is not None:
            self.console.print(line)  # the consoles of run/console.py print plain, unwrapped lines
        if self.log is not None:
            self.log(line)


class CountedProgress:
    """Work counted in units that may each take minutes (a validation's cases, each slid over by hundreds of
    windows): a bar on a terminal (`bar`), plain lines a minute on `lines_console` and `log` (`ProgressLines`).

    `done(completed)` after each unit; `tick()` in between (a unit's inner calls), so that a line still comes
    once a minute while one long unit runs. A line comes at once when the work starts.
    """

    def __init__(self, description: str, total: int, *, console: Console, bar: bool, lines_console: Console | None,
                 log: Callable[[str], None] | None, scope: str = "", rest: tuple[str, int, float] | None = None,
                 unit: str = "case") -> None:
        self.completed = 0
        self._bar = progress_bar(description, console=console, transient=True, disable=not bar)
        self._task = self._bar.add_task(description, total=total)
        self._lines = ProgressLines(description, total, console=lines_console, log=log, scope=scope, rest=rest,
                                    unit=unit)

    def __enter__(self) -> CountedProgress:
        self._bar.start()
        self.tick()  # the first line: the work has started
        return self

    def __exit__(self, *exc) -> None:
        self._bar.stop()

    def done(self, completed: int) -> None:
        self.completed = completed
        self._bar.update(self._task, completed=completed)
        self._lines.update(completed)

    def tick(self) -> None:
        self._lines.update(self.completed)


def _clock_time(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def duration_text(seconds: float) -> str:
    """A duration for people: "45 s", "4 min", "2 h 05 min", "72 h", "5 d 3 h" (not "0.0666667 h")."""
    if round(seconds) < 90:
        return f"{round(seconds)} s"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 100:
        return f"{hours} h" + (f" {minutes:02d} min" if minutes else "")
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days} d" + (f" {hours} h" if hours else "")
