"""`python -m brats_swap ...` behaves exactly like the `brats-swap` console script."""

from brats_swap.cli.main import main
from brats_swap.distributed import restore_forwarded_signals

if __name__ == "__main__":
    restore_forwarded_signals()  # a torchrun rank of `--nproc` (torchrun runs `-m brats_swap`)
    main()
