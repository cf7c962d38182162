"""BraTS-format phantom cases: procedural brains with gliomas, for the demo and the tests.

Written by hand (no template download): the demo and CI must run offline and fast, and a procedural
anatomy lets every case differ. Each case is a skull-stripped brain in a zero background, like BraTS:

- shape: an egg-shaped ellipsoid with a smooth random deformation (low-resolution noise upsampled);
- tissues: white matter inside, a grey-matter cortical ribbon with sulci (zero crossings of a folding noise
  field, lined with grey matter and filled with CSF), an interhemispheric fissure, deep grey nuclei and
  two banana-shaped lateral ventricles of random size;
- a glioma at a random place with nested regions: edema (spreading less into grey matter), a tumour core
  with an enhancing rim of random thickness around a necrotic centre; some tumours do not enhance
  (LGG-like) or have no necrosis; about a third are large, more than half the brain across (over 128 voxels
  at 240x240x155), and every boundary is made irregular by its own noise field;
- contrasts per modality (relative to white matter): T1 WM bright, CSF dark; T1ce like T1 plus a bright
  enhancing rim; T2 CSF and edema bright; FLAIR CSF dark, edema brightest;
- a smooth multiplicative bias field per modality, fine tissue texture, and Rician noise inside the brain.

Files use the exact names of the chosen edition (`BraTS2021_00000/BraTS2021_00000_t1.nii.gz`,
`BraTS-GLI-00000-000/BraTS-GLI-00000-000-t1n.nii.gz`, ...), int16 images, a uint8 segmentation in the
edition's label values and the 1 mm affine of real BraTS files. Speed comes from computing only inside the
brain's bounding box, building quadratic forms from 1-D/2-D pieces, and making every noise field at low
resolution and upsampling it with separable cubic B-spline matrices (three small matrix products).
Deterministic: case i of seed s is the same bytes whatever else is generated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from brats_swap.data.editions import CANONICAL_MODALITIES, EDITIONS, get_edition
from brats_swap.data.nifti import save_nifti
from brats_swap.progress import progress_bar

# Mean intensity per tissue and modality, relative to white matter on T1 (channel order t1, t1ce, t2, flair).
_CONTRAST = {
    #                t1     t1ce   t2     flair
    "csf":         (0.30, 0.32, 1.60, 0.20),
    "gm":          (0.65, 0.68, 0.95, 0.95),
    "wm":          (0.90, 0.90, 0.70, 0.75),
    "edema":       (0.55, 0.56, 1.35, 1.55),
    "necrosis":    (0.25, 0.24, 1.55, 0.85),
    "enhancing":   (0.62, 1.55, 1.00, 1.15),
}


@dataclass
class PhantomCase:
    case_id: str
    images: np.ndarray  # int16 (4, X, Y, Z) in CANONICAL_MODALITIES order
    seg: np.ndarray  # uint8 (X, Y, Z), the edition's label values
    affine: np.ndarray  # 4x4, 1 mm, BraTS orientation


def brats_affine(shape) -> np.ndarray:
    """The affine of real BraTS files (LPS-flipped x/y, 1 mm, origin at (0, Y-1, 0))."""
    return np.array([[-1.0, 0, 0, 0], [0, -1.0, 0, float(shape[1] - 1)], [0, 0, 1.0, 0], [0, 0, 0, 1]])


def phantom_case_id(edition: str, index: int) -> str:
    """A BraTS-style id for phantom `index` in `edition`'s naming scheme."""
    if edition == "2017":
        return f"Brats17_SYN_{index + 1:03d}_1"
    if edition in ("2018", "2019", "2020"):
        return f"BraTS{edition[2:]}_Training_{index + 1:03d}"
    if edition == "2021":
        return f"BraTS2021_{index:05d}"
    return f"BraTS-GLI-{index:05d}-000"


def synthesize_dataset(out: str | os.PathLike, cases: int, seed: int, edition: str = "2021",
                       shape=(240, 240, 155), progress: bool = False) -> list[str]:
    """Write `cases` phantom cases under `out` (one folder per case); returns their ids."""
    spec = get_edition(edition)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    separator = "-" if edition == "2023" else "_"
    ids = []

    with progress_bar(disable=not progress) as bar:
        task = bar.add_task("synth", total=cases)
        for index in range(cases):
            case_id = phantom_case_id(edition, index)
            case = synthesize_case(shape, seed=seed, index=index, edition=edition, case_id=case_id)
            folder = out_dir / case_id
            for channel, modality in enumerate(CANONICAL_MODALITIES):
                name = f"{case_id}{separator}{spec.modality_suffixes[modality]}.nii.gz"
                save_nifti(case.images[channel], case.affine, folder / name, compresslevel=1)
            save_nifti(case.seg, case.affine, folder / f"{case_id}{separator}{spec.seg_suffix}.nii.gz",
                       compresslevel=1)
            ids.append(case_id)
            bar.advance(task)
    return ids


def synthesize_case(shape=(240, 240, 155), seed: int = 0, index: int = 0, edition: str = "2021",
                    case_id: str | None = None, large_tumour: bool | None = None) -> PhantomCase:
    """One phantom case in memory. `large_tumour` forces (or forbids) a tumour over half the brain across."""
    if edition not in EDITIONS:
        raise KeyError(f"unknown BraTS edition {edition!r}")
    shape = tuple(int(s) for s in shape)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(index)]))
    spec = get_edition(edition)

    # --- brain geometry (mm; 1 mm voxels), computed only in the brain's bounding box --------------------
    scale = rng.uniform(0.94, 1.06)
    axes = np.array([0.29 * shape[0], 0.36 * shape[1], 0.40 * shape[2]]) * scale  # left-right, ant-post, sup-inf
    centre = np.array(shape) / 2 + rng.uniform(-0.02, 0.02, 3) * np.array(shape)
    lo = np.maximum(np.floor(centre - 1.2 * axes).astype(int), 0)
    hi = np.minimum(np.ceil(centre + 1.2 * axes).astype(int) + 1, shape)
    box = tuple(int(h - lo_) for lo_, h in zip(lo, hi, strict=True))
    x, y, z = (np.arange(lo[a], hi[a], dtype=np.float32) - np.float32(centre[a]) for a in range(3))
    x, y, z = x[:, None, None], y[None, :, None], z[None, None, :]
    a, b, c = (np.float32(v) for v in axes)

    shape_noise = smooth_noise(rng, box, cells=(3, 3, 3))
    # Egg shape: wider at the back. rho < 1 is the brain.
    width = a * (1 + 0.10 * y / b)
    rho = np.sqrt((x / width) ** 2 + (y / b) ** 2 + (z / c) ** 2) * (1 + 0.05 * shape_noise)
    brain = rho < 1
    depth = (1 - rho) * min(a, b, c)  # ~ mm below the surface

    # --- tissue fractions ------------------------------------------------------------------------------------
    fold_cells = tuple(max(2, int(n / 5)) for n in box)  # 5 mm knots -> gyri ~10 mm wide
    folding = smooth_noise(rng, box, cells=fold_cells)
    sulcal_depth = np.float32(0.22 * min(a, b, c))
    in_cortex = np.clip((sulcal_depth - depth) / 2, 0, 1)  # 1 near the surface, 0 deep
    sulcus = np.clip((0.10 - np.abs(folding)) / 0.05, 0, 1) * in_cortex
    gyral_gm = np.clip((0.55 - np.abs(folding)) / 0.15, 0, 1) * in_cortex
    ribbon = np.clip((0.06 * min(a, b, c) - depth) / 1.5, 0, 1)  # outer cortical ribbon
    gm = np.maximum(gyral_gm, ribbon)

    # Interhemispheric fissure: a thin CSF sheet, bent by the shape noise, above the ventricles.
    midline = np.abs(x + 3 * shape_noise)
    upper = np.clip((z / c + 0.1) / 0.1, 0, 1)
    fissure = np.clip((1.5 - midline) / 1.0, 0, 1) * upper
    gm = np.maximum(gm, np.clip((5.0 - midline) / 2.0, 0, 1) * upper)

    # Deep grey nuclei (thalamus / basal ganglia) either side of the midline.
    nuclei = ((np.abs(x) - 0.27 * a) / (0.14 * a)) ** 2 + (y / (0.2 * b)) ** 2 + ((z + 0.05 * c) / (0.16 * c)) ** 2
    gm = np.maximum(gm, 0.8 * np.clip((1 - nuclei) / 0.2, 0, 1))

    # Lateral ventricles: elongated front-to-back, bent down at both ends, random size.
    v = np.float32(rng.uniform(0.7, 1.6))
    bend = 0.25 * c * (y / b) ** 2
    ventricle = (((np.abs(x) - 0.13 * a) / (0.10 * a * v)) ** 2 + (y / (0.38 * b)) ** 2
                 + ((z - 0.12 * c + bend) / (0.11 * c * v)) ** 2)
    csf = np.maximum(np.maximum(sulcus, fissure), np.clip((1 - ventricle) / 0.15, 0, 1))
    gm = np.minimum(gm, 1 - csf)
    wm = 1 - csf - gm

    # --- the glioma ------------------------------------------------------------------------------------------
    large = bool(rng.random() < 1 / 3) if large_tumour is None else bool(large_tumour)
    side = rng.choice([-1.0, 1.0])
    if large:
        # Long axis front-to-back through the middle of one hemisphere: > 0.5 of the volume across.
        radii = np.array([rng.uniform(0.45, 0.6) * a, rng.uniform(1.0, 1.1) * b, rng.uniform(0.45, 0.6) * c])
        t_centre = np.array([side * rng.uniform(0.25, 0.4) * a, rng.uniform(-0.05, 0.05) * b,
                             rng.uniform(-0.1, 0.2) * c])
        max_angle = 0.25
    else:
        radii = rng.uniform(0.2, 0.45, 3) * np.array([a, b, c])
        t_centre = np.array([side * rng.uniform(0.2, 0.5) * a, rng.uniform(-0.5, 0.5) * b,
                             rng.uniform(-0.3, 0.4) * c])
        max_angle = np.pi
    rotation = _rotation(rng, max_angle)
    t_centre = t_centre.astype(np.float32)  # float64 scalars would silently promote every full-size array
    dx, dy, dz = x - t_centre[0], y - t_centre[1], z - t_centre[2]
    tumour_noise = smooth_noise(rng, box, cells=tuple(max(2, int(n / 20)) for n in box))
    # Edema spreads along white matter, less into grey matter.
    tau_edema = (np.sqrt(_quadratic_form(dx, dy, dz, rotation, radii)) * (1 + 0.25 * tumour_noise + 0.06 * folding)
                 + 0.12 * gm)
    core_fraction = rng.uniform(0.3, 0.45) if large else rng.uniform(0.35, 0.65)
    core_radii = radii * core_fraction * rng.uniform(0.85, 1.15, 3)
    core_noise = smooth_noise(rng, box, cells=tuple(max(2, int(n / 14)) for n in box))
    tau_core = np.sqrt(_quadratic_form(dx, dy, dz, rotation, core_radii)) * (1 + 0.2 * core_noise + 0.05 * folding)

    kind = rng.random()
    enhancing = kind >= 0.2  # one in five does not enhance (LGG-like)
    rim = float(rng.uniform(0.25, 0.5)) if kind < 0.85 else 1.0  # 15%: solid enhancing core, no necrosis
    rim_edge = (1 - rim) * (1 + 0.35 * core_noise - 0.1 * folding)  # irregular rim thickness

    core_mask = (tau_core < 1) & brain
    seg = np.zeros(box, dtype=np.uint8)
    seg[(tau_edema < 1) & brain] = spec.edema
    necrotic_label = next(v for v in spec.region_labels["TC"] if v != spec.enhancing)
    if enhancing:
        seg[core_mask] = spec.enhancing
        seg[core_mask & (tau_core < rim_edge)] = necrotic_label
    else:
        seg[core_mask] = necrotic_label

    # Soft memberships (about 1 mm of partial volume at each boundary).
    w_edema = np.clip((1 - tau_edema) / 0.04, 0, 1)
    w_core = np.clip((1 - tau_core) / 0.05, 0, 1)
    w_necrosis = np.clip((rim_edge - tau_core) / 0.05, 0, 1) if enhancing else np.ones_like(w_core)

    # --- intensities ------------------------------------------------------------------------------------------
    texture = 1 + 0.04 * smooth_noise(rng, box, cells=tuple(max(2, int(n / 4)) for n in box))
    heterogeneity = 1 + 0.10 * core_noise
    inside = np.flatnonzero(brain)
    images = np.zeros((len(CANONICAL_MODALITIES), *shape), dtype=np.int16)
    for channel in range(len(CANONICAL_MODALITIES)):
        value = {name: np.float32(contrast[channel]) for name, contrast in _CONTRAST.items()}
        tissue = csf * value["csf"] + gm * value["gm"] + wm * value["wm"]
        core = w_necrosis * value["necrosis"] + (1 - w_necrosis) * value["enhancing"] if enhancing \
            else value["necrosis"] + 0.2 * (value["edema"] - value["necrosis"])
        intensity = tissue * texture
        intensity += w_edema * (value["edema"] * heterogeneity - intensity)
        intensity += w_core * (core * heterogeneity - intensity)
        bias = np.exp(0.12 * smooth_noise(rng, box, cells=(2, 2, 2)))
        gain = rng.uniform(400, 900)
        signal = (intensity * bias).ravel()[inside] * np.float32(gain)
        sigma = np.float32(0.025 * gain)
        noisy = np.hypot(signal + sigma * rng.standard_normal(inside.size, dtype=np.float32),
                         sigma * rng.standard_normal(inside.size, dtype=np.float32))
        # BraTS backgrounds are exactly 0; brain voxels are >= 1 so the brain mask survives rounding.
        values = np.zeros(int(np.prod(box)), dtype=np.int16)
        values[inside] = np.clip(np.rint(noisy), 1, 32767).astype(np.int16)
        images[channel][tuple(slice(lo_, h) for lo_, h in zip(lo, hi, strict=True))] = values.reshape(box)

    full_seg = np.zeros(shape, dtype=np.uint8)
    full_seg[tuple(slice(lo_, h) for lo_, h in zip(lo, hi, strict=True))] = seg
    return PhantomCase(case_id=case_id or phantom_case_id(edition, index), images=images, seg=full_seg,
                       affine=brats_affine(shape))


def smooth_noise(rng: np.random.Generator, shape, cells) -> np.ndarray:
    """Zero-mean, unit-std smooth random field of `shape` (float32): Gaussian values on a coarse grid
    (`cells` intervals per axis) upsampled with cubic B-splines, one matrix product per axis."""
    coarse = rng.standard_normal([int(c) + 3 for c in cells]).astype(np.float32)
    w0, w1, w2 = (_bspline_matrix(int(n), int(c)) for n, c in zip(shape, cells, strict=True))
    field = (w0 @ coarse.reshape(coarse.shape[0], -1)).reshape(len(w0), *coarse.shape[1:])
    field = np.matmul(w1, field)  # (n0, n1, m2)
    field = field @ w2.T  # (n0, n1, n2)
    # A cubic B-spline of unit-variance knots has variance sum(w^2) ~ 0.48 between knots; rescale to ~1.
    return field * np.float32(1 / 0.69)


def _bspline_matrix(n: int, cells: int) -> np.ndarray:
    """(n, cells + 3) weights of the 4 cubic B-spline knots around each of n samples spread over `cells`."""
    t = (np.arange(n) + 0.5) / n * cells  # sample positions in knot units, in [0, cells)
    i = np.floor(t).astype(int)
    f = t - i
    weights = np.stack([(1 - f) ** 3 / 6, (3 * f**3 - 6 * f**2 + 4) / 6, (-3 * f**3 + 3 * f**2 + 3 * f + 1) / 6,
                        f**3 / 6], axis=1)
    matrix = np.zeros((n, cells + 3), dtype=np.float32)
    for k in range(4):
        matrix[np.arange(n), i + k] = weights[:, k]
    return matrix


def _rotation(rng: np.random.Generator, max_angle: float) -> np.ndarray:
    angles = rng.uniform(-max_angle, max_angle, 3)
    cx, cy, cz = np.cos(angles)
    sx, sy, sz = np.sin(angles)
    rx = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    ry = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    rz = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    return rz @ ry @ rx


def _quadratic_form(dx, dy, dz, rotation: np.ndarray, radii) -> np.ndarray:
    """Squared ellipsoidal radius d^T M d with M = R diag(1/r^2) R^T, summed from 1-D and 2-D pieces."""
    m = (rotation @ np.diag(1 / np.asarray(radii, dtype=float) ** 2) @ rotation.T).astype(np.float32)
    return (m[0, 0] * dx**2 + m[1, 1] * dy**2 + 2 * m[0, 1] * dx * dy) + (
        m[2, 2] * dz**2 + 2 * m[0, 2] * dx * dz + 2 * m[1, 2] * dy * dz)
