"""`python -m brats_swap ...` behaves exactly like the `brats-swap` console script."""

from brats_swap.cli.main import main

if __name__ == "__main__":
    main()
