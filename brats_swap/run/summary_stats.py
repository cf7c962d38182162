"""The one standard-deviation convention of every report: the sample standard deviation (ddof 1).

Evaluation summaries (`summary.json/md` of a fold or of `evaluate --predictions`), the official lesion-wise
summary (as the official BraTS evaluation reports it) and the cross-validation and comparison tables all
give mean ± `sample_std`: the spread of the cases (or folds) as a sample, n − 1 in the denominator, not
given for fewer than two values. `STD_NOTE` says so in each report.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

STD_NOTE = "std: the sample standard deviation (n − 1 in the denominator)"


def sample_std(values: Sequence[float] | np.ndarray) -> float | None:
    """The sample standard deviation (ddof 1) of `values`; None for fewer than two. An infinite value makes
    it NaN (the official summary keeps infinite HD95s in)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size < 2:
        return None
    with np.errstate(invalid="ignore"):
        return float(array.std(ddof=1))
