"""BraTS data: editions (file names, labels), discovery, NIfTI I/O and validation, preprocessing with an
on-disk cache, and the phantom generator. Import from the submodules (`brats_swap.data.cache`, ...); this
file stays empty so that `import brats_swap.data.challenges` does not pull in torch."""
