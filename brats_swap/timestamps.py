"""The one spelling of "now" in the files a run writes: UTC, to the second, ISO 8601 (`2026-01-31T23:59:59Z`).

cv.log lines, fold_<k>/state.json's `evaluated_at`, cv_summary.json and compare.json's `generated_at` use it,
so their times sort as text and compare across machines in different time zones.
"""

from __future__ import annotations

from datetime import datetime, timezone

UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime(UTC_FORMAT)


__all__ = ["UTC_FORMAT", "utc_now"]
