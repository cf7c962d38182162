"""The training augmentation: the recipes `train.augment` names, each applied to the whole batch on the
training device.

One door (`registry.py`): `RECIPE_NAMES` and `get_recipe(name) -> AugmentRecipe`, an object with the crop a
loader worker reads (`crop_size`), the per-sample parameters drawn there from the sample's own generator
(`draw`, cheap: plain numbers, picklable), their application to the batch on the device (`apply`) and the
device bytes that holds (`buffer_bytes`). The recipes:

- `cube48` (`cube.py`): one of the 48 rotations/reflections of the cube, the paper's; `none` (`cube.py`).
- `nnunet` (`nnunet.py`): nnunetv2 2.8.1's `get_training_transforms`, batched: the spatial transform
  (`spatial.py`: one grid_sample for all samples that draw rotation, scaling or elastic deformation; the
  others are centre-cropped), then the recipe's steps in nnU-Net's order, one module each in `steps/` (noise,
  blur, brightness, contrast, low resolution, inverted gamma, additive brightness, gamma, mirroring, and
  `mask_outside`: the image zeroed in every channel where the label is -1, then -1 turned into 0). A recipe
  table (`recipes.py`) is the spatial parameters, that tuple of steps and the crop rule; a step is its own
  parameters with its draw, its batched apply and its peak bytes, so `pipeline.augment_batch` and the byte
  bound both iterate the recipe's own steps. Every transform follows batchgeneratorsv2's semantics, shown
  equal to that library built with nnU-Net's own arguments (tests/test_augment_faithful.py) and in its
  distributions (tests/test_augment_draws.py).
- `nnunet_brats2020` (`nnunet.py`): the stronger set of nnU-Net's BraTS 2020 entry (sources and parameters
  in `recipes.py`).
- `mild` (`mild.py`): a light MONAI set.

In both nnU-Net recipes space outside the input is labelled -1, so the mask step zeroes the image there:
nnunetv2 2.7+ (`border_mode_seg='constant', padding_value_seg=-1`) and nnU-Net v1's get_insaneDA_augmentation2
(`border_val_seg=-1`) alike. For whole-volume training the input is the cube itself: where the rotated or
shrunk patch reaches past it, the image is sampled as 0 and the labels as -1. The nnU-Net recipes'
application is deterministic given the parameters on one device (noise fields come from a torch.Generator
seeded from the parameters' `seed` on the tensors' device, so CPU and CUDA draw different noise images from
the same seed).

Imports: torch, numpy (MONAI inside `mild`) and the standard library; `registry.py` the standard library
only, so the config checks names without torch. Nothing above imports into it.
"""

from brats_swap.augment.registry import RECIPE_NAMES, AugmentRecipe, get_recipe

__all__ = ["RECIPE_NAMES", "AugmentRecipe", "get_recipe"]
