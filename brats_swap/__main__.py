"""`python -m brats_swap ...` behaves exactly like the `brats-swap` console script."""

from brats_swap.cli.main import main
from brats_swap.stop_signals import restore_after_torchrun

if __name__ == "__main__":
    restore_after_torchrun()  # a torchrun rank of `--nproc` (torchrun runs `-m brats_swap`)
    main()
