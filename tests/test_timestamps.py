"""brats_swap/timestamps.py: the one "now" of the files a run writes."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from brats_swap import timestamps
from brats_swap.cv import comparison, invocation, runner, summary


def test_utc_now_is_iso_utc_to_the_second():
    stamp = timestamps.utc_now()
    parsed = datetime.strptime(stamp, timestamps.UTC_FORMAT).replace(tzinfo=timezone.utc)
    assert stamp.endswith("Z") and len(stamp) == len("2026-01-31T23:59:59Z")
    assert abs(datetime.now(timezone.utc) - parsed) < timedelta(seconds=5)


def test_every_writer_of_a_run_file_uses_the_one_clock():
    # The summary module used to define it for the others; now each takes it from the time module.
    assert all(module.utc_now is timestamps.utc_now for module in (summary, runner, invocation, comparison))
    assert "def utc_now" not in summary.__loader__.get_source(summary.__name__)
