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
- what some challenges add: one to three more metastases (MET), a fluid-filled resection cavity next to
  the tumour (GLI post-treatment and MET, label RC), a cyst inside the tumour core (PED, label CC);
- contrasts per modality (relative to white matter): T1 WM bright, CSF dark; T1ce like T1 plus a bright
  enhancing rim; T2 CSF and edema bright; FLAIR CSF dark, edema brightest;
- a smooth multiplicative bias field per modality, fine tissue texture, and Rician noise inside the brain.

Files use the exact names of the chosen edition or challenge (`BraTS2021_00000/BraTS2021_00000_t1.nii.gz`,
`BraTS-PED-00000-000/BraTS-PED-00000-000-t1n.nii.gz`, `BraTS-MEN-RT-0001-1/BraTS-MEN-RT-0001-1_t1c.nii.gz`
and `_gtv` only, ...), int16 images, a uint8 segmentation in that table's label values (each tissue
mapped through `ChallengeSpec.tissues`: PED's ET is 1, MEN-RT's GTV is the tumour core without edema)
and the 1 mm affine of real BraTS files. Speed comes from computing only inside the
brain's bounding box, building quadratic forms from 1-D/2-D pieces, and making every noise field at low
resolution and upsampling it with separable cubic B-spline matrices (three small matrix products).
Deterministic: case i of seed s is the same bytes whatever else is generated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from brats_swap.data.challenges import CANONICAL_MODALITIES, ChallengeSpec, get_challenge
from brats_swap.data.nifti import save_nifti
from brats_swap.errors import DataError
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
    "cavity":      (0.28, 0.30, 1.65, 0.25),  # resection cavity: fluid, like CSF
    "cyst":        (0.35, 0.37, 1.70, 0.60),  # tumour cyst: fluid with protein, brighter than CSF on FLAIR
}


@dataclass
class PhantomCase:
    case_id: str
    images: np.ndarray  # int16 (4, X, Y, Z) in CANONICAL_MODALITIES order (files: those the challenge ships)
    seg: np.ndarray  # uint8 (X, Y, Z), the challenge's label values
    affine: np.ndarray  # 4x4, 1 mm, BraTS orientation


@dataclass
class _Anatomy:
    """The brain of one phantom, inside its bounding box [lo, hi) of the volume (coordinates in mm)."""

    shape: tuple[int, int, int]
    lo: np.ndarray
    hi: np.ndarray
    box: tuple[int, int, int]
    x: np.ndarray  # (bx, 1, 1), (1, by, 1), (1, 1, bz): offsets from the brain centre
    y: np.ndarray
    z: np.ndarray
    axes: tuple[np.float32, np.float32, np.float32]  # brain half-axes a (left-right), b, c
    brain: np.ndarray  # bool
    folding: np.ndarray  # the cortical folding noise field
    csf: np.ndarray  # tissue fractions
    gm: np.ndarray
    wm: np.ndarray


@dataclass
class _Lesion:
    """One tumour: hard masks for the labels, soft memberships for the intensities."""

    edema: np.ndarray
    core: np.ndarray
    necrosis: np.ndarray
    w_edema: np.ndarray
    w_core: np.ndarray
    w_necrosis: np.ndarray
    enhancing: bool
    heterogeneity: np.ndarray
    centre: np.ndarray
    core_radii: np.ndarray
    rotation: np.ndarray


@dataclass
class _Fluid:
    """A fluid-filled part drawn over the tumour: the resection cavity (RC) or a cyst (PED's CC)."""

    tissue: str  # "cavity" or "cyst" (a key of _CONTRAST and of the challenge's tissues)
    mask: np.ndarray
    weight: np.ndarray


# Metastases come several to a case: this many lesions besides the first one (inclusive range).
_EXTRA_LESIONS = {"met": (1, 3)}


def brats_affine(shape) -> np.ndarray:
    """The affine of real BraTS files (LPS-flipped x/y, 1 mm, origin at (0, Y-1, 0))."""
    return np.array([[-1.0, 0, 0, 0], [0, -1.0, 0, float(shape[1] - 1)], [0, 0, 1.0, 0], [0, 0, 0, 1]])


def phantom_case_id(edition: str, index: int) -> str:
    """A BraTS-style id for phantom `index` in the naming scheme of `edition` (any key of the challenge table)."""
    return get_challenge(edition).example_id(index)


def synthesize_dataset(out: str | os.PathLike, cases: int, seed: int, edition: str = "2021",
                       shape=(240, 240, 155), progress: bool = False, id_offset: int = 0) -> list[str]:
    """Write `cases` phantom cases under `out` (one folder per case); returns their ids.

    `edition` is any key of the challenge table ("2021", "2023", "ped", "men-rt", ...): it decides the file
    names, which modalities are written (MEN-RT: t1c only) and the labels. Case `k` is drawn from
    (`seed`, `k`) and named with number `id_offset + k`, so two folders made with different offsets never
    share a case id (`data synth` offsets by the seed)."""
    if id_offset < 0:
        raise DataError(f"synth: the case id offset must be >= 0, got {id_offset}")
    spec = get_challenge(edition)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = []

    with progress_bar(disable=not progress) as bar:
        task = bar.add_task("synth", total=cases)
        for index in range(cases):
            case_id = phantom_case_id(edition, id_offset + index)
            case = synthesize_case(shape, seed=seed, index=index, edition=edition, case_id=case_id)
            folder = out_dir / case_id
            for channel, modality in enumerate(CANONICAL_MODALITIES):
                if modality in spec.modality_suffixes:
                    name = f"{case_id}{spec.separator}{spec.modality_suffixes[modality]}.nii.gz"
                    save_nifti(case.images[channel], case.affine, folder / name, compresslevel=1)
            save_nifti(case.seg, case.affine, folder / f"{case_id}{spec.separator}{spec.seg_suffix}.nii.gz",
                       compresslevel=1)
            ids.append(case_id)
            bar.advance(task)
    return ids


def synthesize_case(shape=(240, 240, 155), seed: int = 0, index: int = 0, edition: str = "2021",
                    case_id: str | None = None, large_tumour: bool | None = None) -> PhantomCase:
    """One phantom case in memory. `large_tumour` forces (or forbids) a tumour over half the brain across.

    The brain, the first tumour and the intensities draw from one generator in a fixed order; what only
    some challenges have (more metastases, a resection cavity, a cyst) draws from a second one, so the
    glioma of a 2017-2023 phantom stays the same bytes whatever the table adds."""
    spec = get_challenge(edition)
    shape = tuple(int(s) for s in shape)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(index)]))
    extra_rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(index), 1]))

    anatomy = _brain_anatomy(rng, shape)
    lesions = [_glioma(rng, anatomy, large_tumour)]
    low, high = _EXTRA_LESIONS.get(spec.key, (0, 0))
    for _ in range(int(extra_rng.integers(low, high + 1))):
        lesions.append(_metastasis(extra_rng, anatomy))
    fluids = [_fluid(extra_rng, anatomy, lesions[0], tissue) for tissue in ("cyst", "cavity") if tissue in spec.tissues]

    seg = _label_map(spec, anatomy, lesions, fluids)
    images = _intensities(rng, anatomy, lesions, fluids)
    full_seg = np.zeros(shape, dtype=np.uint8)
    full_seg[_box_slices(anatomy)] = seg
    return PhantomCase(case_id=case_id or phantom_case_id(edition, index), images=images, seg=full_seg,
                       affine=brats_affine(shape))


def _brain_anatomy(rng: np.random.Generator, shape: tuple[int, int, int]) -> _Anatomy:
    """Brain shape and tissue fractions (mm; 1 mm voxels), computed only in the brain's bounding box."""
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
    return _Anatomy(shape, lo, hi, box, x, y, z, (a, b, c), brain, folding, csf, gm, wm)


def _glioma(rng: np.random.Generator, anatomy: _Anatomy, large_tumour: bool | None) -> _Lesion:
    """The main tumour: edema around a core with an enhancing rim of random thickness round a necrotic
    centre; one in five does not enhance (LGG-like), some have no necrosis, about a third are large."""
    a, b, c = anatomy.axes
    large = bool(rng.random() < 1 / 3) if large_tumour is None else bool(large_tumour)
    side = rng.choice([-1.0, 1.0])
    if large:
        # Long axis front-to-back through the middle of one hemisphere: > 0.5 of the volume across.
        radii = np.array([rng.uniform(0.45, 0.6) * a, rng.uniform(1.0, 1.1) * b, rng.uniform(0.45, 0.6) * c])
        centre = np.array([side * rng.uniform(0.25, 0.4) * a, rng.uniform(-0.05, 0.05) * b,
                           rng.uniform(-0.1, 0.2) * c])
        max_angle = 0.25
    else:
        radii = rng.uniform(0.2, 0.45, 3) * np.array([a, b, c])
        centre = np.array([side * rng.uniform(0.2, 0.5) * a, rng.uniform(-0.5, 0.5) * b,
                           rng.uniform(-0.3, 0.4) * c])
        max_angle = np.pi
    rotation = _rotation(rng, max_angle)
    tumour_noise = smooth_noise(rng, anatomy.box, cells=tuple(max(2, int(n / 20)) for n in anatomy.box))
    core_fraction = rng.uniform(0.3, 0.45) if large else rng.uniform(0.35, 0.65)
    core_radii = radii * core_fraction * rng.uniform(0.85, 1.15, 3)
    core_noise = smooth_noise(rng, anatomy.box, cells=tuple(max(2, int(n / 14)) for n in anatomy.box))
    kind = rng.random()
    rim = float(rng.uniform(0.25, 0.5)) if kind < 0.85 else 1.0  # 15%: solid enhancing core, no necrosis
    return _lesion(anatomy, centre, rotation, radii, core_radii, tumour_noise, core_noise,
                   enhancing=kind >= 0.2, rim=rim)


def _metastasis(rng: np.random.Generator, anatomy: _Anatomy) -> _Lesion:
    """A small round metastasis anywhere in the brain: an enhancing ring round necrosis, in its own edema."""
    a, b, c = anatomy.axes
    radii = rng.uniform(0.12, 0.22, 3) * np.array([a, b, c])
    centre = rng.uniform(-0.55, 0.55, 3) * np.array([a, b, c])
    core_radii = radii * rng.uniform(0.45, 0.6, 3)
    tumour_noise = smooth_noise(rng, anatomy.box, cells=tuple(max(2, int(n / 20)) for n in anatomy.box))
    core_noise = smooth_noise(rng, anatomy.box, cells=tuple(max(2, int(n / 14)) for n in anatomy.box))
    return _lesion(anatomy, centre, _rotation(rng, np.pi), radii, core_radii, tumour_noise, core_noise,
                   enhancing=True, rim=float(rng.uniform(0.3, 0.5)))


def _lesion(anatomy: _Anatomy, centre, rotation, radii, core_radii, tumour_noise, core_noise, enhancing: bool,
            rim: float) -> _Lesion:
    """Masks and memberships of one tumour from its shape parameters and noise fields."""
    centre = np.asarray(centre).astype(np.float32)  # float64 scalars would silently promote every full-size array
    dx, dy, dz = anatomy.x - centre[0], anatomy.y - centre[1], anatomy.z - centre[2]
    folding, brain = anatomy.folding, anatomy.brain
    # Edema spreads along white matter, less into grey matter.
    tau_edema = (np.sqrt(_quadratic_form(dx, dy, dz, rotation, radii)) * (1 + 0.25 * tumour_noise + 0.06 * folding)
                 + 0.12 * anatomy.gm)
    tau_core = np.sqrt(_quadratic_form(dx, dy, dz, rotation, core_radii)) * (1 + 0.2 * core_noise + 0.05 * folding)
    rim_edge = (1 - rim) * (1 + 0.35 * core_noise - 0.1 * folding)  # irregular rim thickness
    core = (tau_core < 1) & brain
    # Soft memberships (about 1 mm of partial volume at each boundary).
    w_core = np.clip((1 - tau_core) / 0.05, 0, 1)
    return _Lesion(
        edema=(tau_edema < 1) & brain, core=core, necrosis=core & (tau_core < rim_edge) if enhancing else core,
        w_edema=np.clip((1 - tau_edema) / 0.04, 0, 1), w_core=w_core,
        w_necrosis=np.clip((rim_edge - tau_core) / 0.05, 0, 1) if enhancing else np.ones_like(w_core),
        enhancing=enhancing, heterogeneity=1 + 0.10 * core_noise, centre=centre,
        core_radii=np.asarray(core_radii), rotation=rotation)


def _fluid(rng: np.random.Generator, anatomy: _Anatomy, lesion: _Lesion, tissue: str) -> _Fluid:
    """A cyst inside the tumour core, or a resection cavity where part of the tumour was removed."""
    inside = tissue == "cyst"
    # A cyst sits within the core; a cavity replaces the side of the tumour it was resected from.
    offset = rng.uniform(-0.3, 0.3, 3) if inside else rng.choice([-1.0, 1.0], 3) * rng.uniform(0.5, 0.8, 3)
    centre = (lesion.centre + offset * lesion.core_radii).astype(np.float32)
    radii = lesion.core_radii * rng.uniform(0.4, 0.55, 3) if inside else lesion.core_radii * rng.uniform(0.7, 1.0, 3)
    dx, dy, dz = anatomy.x - centre[0], anatomy.y - centre[1], anatomy.z - centre[2]
    tau = np.sqrt(_quadratic_form(dx, dy, dz, _rotation(rng, np.pi), radii))
    mask = (tau < 1) & (lesion.core if inside else anatomy.brain)
    return _Fluid(tissue, mask, np.clip((1 - tau) / 0.05, 0, 1) * mask)


def _label_map(spec: ChallengeSpec, anatomy: _Anatomy, lesions: list[_Lesion], fluids: list[_Fluid]) -> np.ndarray:
    """The label values of the challenge's table painted from the tissues it labels (others stay 0)."""
    label = spec.tissues.get
    seg = np.zeros(anatomy.box, dtype=np.uint8)
    for lesion in lesions:
        seg[lesion.edema] = label("edema", 0)
    for lesion in lesions:
        seg[lesion.core] = label("enhancing" if lesion.enhancing else "necrosis", 0)
        seg[lesion.necrosis] = label("necrosis", 0)
    for fluid in fluids:
        seg[fluid.mask] = label(fluid.tissue, 0)
    return seg


def _intensities(rng: np.random.Generator, anatomy: _Anatomy, lesions: list[_Lesion],
                 fluids: list[_Fluid]) -> np.ndarray:
    """int16 (4, X, Y, Z) images: tissue contrasts, texture, tumours and fluids, bias field, Rician noise."""
    box = anatomy.box
    texture = 1 + 0.04 * smooth_noise(rng, box, cells=tuple(max(2, int(n / 4)) for n in box))
    inside = np.flatnonzero(anatomy.brain)
    images = np.zeros((len(CANONICAL_MODALITIES), *anatomy.shape), dtype=np.int16)
    for channel in range(len(CANONICAL_MODALITIES)):
        value = {name: np.float32(contrast[channel]) for name, contrast in _CONTRAST.items()}
        tissue = anatomy.csf * value["csf"] + anatomy.gm * value["gm"] + anatomy.wm * value["wm"]
        intensity = tissue * texture
        for lesion in lesions:
            core = lesion.w_necrosis * value["necrosis"] + (1 - lesion.w_necrosis) * value["enhancing"] \
                if lesion.enhancing else value["necrosis"] + 0.2 * (value["edema"] - value["necrosis"])
            intensity += lesion.w_edema * (value["edema"] * lesion.heterogeneity - intensity)
            intensity += lesion.w_core * (core * lesion.heterogeneity - intensity)
        for fluid in fluids:
            intensity += fluid.weight * (value[fluid.tissue] * texture - intensity)
        bias = np.exp(0.12 * smooth_noise(rng, box, cells=(2, 2, 2)))
        gain = rng.uniform(400, 900)
        signal = (intensity * bias).ravel()[inside] * np.float32(gain)
        sigma = np.float32(0.025 * gain)
        noisy = np.hypot(signal + sigma * rng.standard_normal(inside.size, dtype=np.float32),
                         sigma * rng.standard_normal(inside.size, dtype=np.float32))
        # BraTS backgrounds are exactly 0; brain voxels are >= 1 so the brain mask survives rounding.
        values = np.zeros(int(np.prod(box)), dtype=np.int16)
        values[inside] = np.clip(np.rint(noisy), 1, 32767).astype(np.int16)
        images[channel][_box_slices(anatomy)] = values.reshape(box)
    return images


def _box_slices(anatomy: _Anatomy) -> tuple[slice, ...]:
    return tuple(slice(int(lo), int(hi)) for lo, hi in zip(anatomy.lo, anatomy.hi, strict=True))


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
