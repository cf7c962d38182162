"""nnU-Net's training augmentation, batched on the training device.

The loader's worker draws each sample's parameters on the CPU from the sample's numpy Generator
(`draw_sample_augment`, cheap: plain numbers), and the training step applies them to the whole batch on the
device (`augment_batch`, CPU tensors in CI, CUDA on a GPU). Every transform follows batchgeneratorsv2's
semantics, shown equal to that library transform by transform (tests/test_augment_faithful.py) and in its
distributions (tests/test_augment_draws.py).

API (imports only torch, numpy and the standard library; `train` may import it, it imports nothing above):

- `RECIPES = ("nnunet", "nnunet_brats2020")`: nnU-Net v2's default `get_training_transforms`, and the
  stronger set of nnU-Net's BraTS 2020 entry (sources and parameters in `recipes.py`).
- `SampleAugment`: one sample's drawn parameters (frozen dataclass of floats, bools and small tuples, plus an
  int `seed` for the full-size random fields: the noise image and the elastic displacement). Picklable;
  collate a batch's as a list.
- `draw_sample_augment(recipe, rng, patch_size, channels) -> SampleAugment`.
- `enlarged_crop_size(recipe, patch_size) -> (X, Y, Z)`: nnU-Net's `get_patch_size`, the crop the loader
  takes around the patch centre so the rotated and scaled patch has no padded corners (128^3 -> 205^3,
  192^3 -> 308^3). For whole-volume training pass the cube itself as the input: where the rotated or
  shrunk patch reaches past the volume, the image is sampled as 0 and the labels as 0 (background), as
  batchgeneratorsv2's zero padding does.
- `augment_batch(images, labels, params, patch_size, label_values) -> (images, labels)`:
  images (B, C, X, Y, Z) float32, labels (B, X, Y, Z) integer with nnU-Net's convention of -1 outside the
  brain mask (its loader's); `label_values` lists the other values the labels may hold, 0 included (BraTS:
  0, 1, 2, 3), a value not listed becomes background where the sample is resampled. The input size may be
  larger than `patch_size` (an enlarged crop): the patch is taken at its centre. Returns new tensors
  (B, C, *patch_size) and (B, *patch_size): spatial transform (one grid_sample for all samples that draw
  rotation, scaling or elastic deformation; the others are centre-cropped), noise, blur, brightness,
  contrast, low resolution, inverted gamma, additive brightness, gamma, mirroring, the image zeroed where the
  label is -1 (MaskImageTransform), then -1 turned into 0. Deterministic given `params` on one device (noise
  fields come from a torch.Generator seeded from `seed` on the tensors' device, so CPU and CUDA draw
  different noise images from the same seed).
- `augment_buffer_bytes(batch, channels, patch_size, num_labels, input_size, element_bytes=4,
  label_bytes=8) -> int`: a bound of the extra device bytes augment_batch allocates at its peak (its outputs
  included, its inputs not), for the memory planner; `num_labels` counts the label values other than -1
  (BraTS: 4), `label_bytes` is the labels' element size. Dominated by the resampling: the image channels and
  one indicator per label stacked at input size, and their sampled patch (2 x 4 x 192^3 whole volumes:
  about 1.8 GB; 2 x 4 x 128^3 patches from 205^3 crops: 0.9 GB).
"""

from brats_swap.augment.pipeline import OUTSIDE_LABEL, augment_batch, augment_buffer_bytes
from brats_swap.augment.recipes import RECIPES, SampleAugment, draw_sample_augment, enlarged_crop_size

__all__ = ["OUTSIDE_LABEL", "RECIPES", "SampleAugment", "augment_batch", "augment_buffer_bytes",
           "draw_sample_augment", "enlarged_crop_size"]
