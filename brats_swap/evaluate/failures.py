"""Cases that failed while the others went on: `predict`, `evaluate` and `serve-challenge` skip a bad case (a
missing or unreadable file, a wrong shape, foreign label values, or any other exception reading or segmenting
it, such as a file nested past Python's recursion limit), finish every other
case, then fail with the list. The project's other errors (a config value, a full disk) and running out of
memory still stop the command (`errors.case_problem`).

A `CaseFailures` collects one line per failed case; `raise_if_any` ends the command with one DataError
(exit 1) naming every failed case, after the outputs of the good cases are written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from brats_swap.errors import DataError, case_problem
from brats_swap.names import printable, shown


@dataclass
class CaseFailures:
    """case id -> the one-line reason it failed, in the order the cases failed."""

    reasons: dict[str, str] = field(default_factory=dict)
    say: Callable[[str], None] | None = None  # told each failure as it happens (e.g. a warning line)

    def __bool__(self) -> bool:
        return bool(self.reasons)

    def __len__(self) -> int:
        return len(self.reasons)

    def add(self, case_id: str, reason: str) -> None:
        # The project's messages usually start with "case <id>:"; a bare reason gets the case id in front. Ids
        # and reasons may quote a file's names: shown so that they cannot start a line (names.py, rule 4).
        line = printable(reason if case_id in reason else f"case {shown(case_id)}: {reason}")
        self.reasons[case_id] = line
        if self.say is not None:
            self.say(f"skipped {line}")

    @contextmanager
    def case(self, case_id: str) -> Iterator[None]:
        """Run one case's work; a DataError (the project's bad-input error: missing or unreadable file,
        wrong shape, foreign labels) or any exception that is not the project's own is recorded and the caller
        goes on with the next case."""
        try:
            yield
        except Exception as exc:  # whatever one case's files make happen, the others go on (errors.case_problem)
            problem = case_problem(case_id, exc)
            if problem is None:
                raise
            self.add(case_id, problem)

    def describe(self) -> str:
        return "; ".join(self.reasons.values())

    def raise_if_any(self, what: str, total: int) -> None:
        """DataError "<what>: N of <total> case(s) failed: <reasons>" when any case failed."""
        if self.reasons:
            raise DataError(f"{what}: {len(self.reasons)} of {total} case(s) failed, the others are done: "
                            f"{self.describe()}")


__all__ = ["CaseFailures"]
