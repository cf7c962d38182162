"""What training and evaluation both need, so that neither imports the other.

- `folder`: the run folder (every path of a run);
- `checkpoint`: checkpoint I/O (checksummed, atomic, with the previous file as fallback);
- `device`: device and AMP resolution, seeds, threads and determinism, peak memory;
- `environment`: the `env.json` record;
- `inference`: whole-cube and sliding-window inference (validation and evaluation);
- `trained`: a trained fold's model and config (evaluation, prediction);
- `dice`: the overlap counts behind validation Dice and the BraTS metrics;
- `console`: the stderr console and warnings.
"""

from brats_swap.run.folder import FoldFolder, RunFolder

__all__ = ["FoldFolder", "RunFolder"]
