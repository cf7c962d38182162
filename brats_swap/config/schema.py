"""The typed configuration schema: one dataclass per YAML section.

Every field has a default, so an empty YAML file is a valid config; the defaults are the paper's
recipe (Isensee 2017 U-Net as Ellis/IBM trained it, 192³ whole volumes). `Literal` fields list the
accepted values; `load_config` rejects anything else with the key's dotted name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Edition = Literal["auto", "2017", "2018", "2019", "2020", "2021", "2023"]
# The 2023+ challenges of the label table `brats_swap.data.challenges.CHALLENGES` (a test keeps them equal).
Challenge = Literal["auto", "gli", "gli-post", "met", "men", "men-rt", "ped", "ssa", "goat"]


@dataclass
class SynthConfig:
    """Phantom generation used by `make demo` and the tests (`brats-swap data synth`)."""

    cases: int = 12
    seed: int = 0
    edition: Literal["2017", "2018", "2019", "2020", "2021", "2023"] = "2021"
    shape: list[int] = field(default_factory=lambda: [240, 240, 155])


@dataclass
class DataConfig:
    root: str = "data/phantoms"  # dataset folder (BraTS download or phantoms)
    cache: str = "data/cache/phantoms-192"  # prepared-cache folder (`brats-swap data prepare`)
    edition: Edition = "auto"  # label convention and file names; `auto` detects from file names
    challenge: Challenge = "auto"  # 2023+ challenge (labels, names, groups); `auto` detects from case ids
    modalities: list[str] = field(default_factory=lambda: ["t1", "t1ce", "t2", "flair"])
    cube: list[int] = field(default_factory=lambda: [192, 192, 192])  # network input size (D, H, W)
    fit: Literal["resample", "pad_crop"] = "resample"  # resample = Ellis/IBM; pad_crop keeps 1 mm
    cache_dtype: Literal["float16", "float32"] = "float16"
    clip_percentiles: list[float] = field(default_factory=lambda: [0.5, 99.5])  # per modality, in the brain
    # Processes of `data check` / `data prepare` (and the prepare step of train/cv). auto: every CPU this
    # process may use (its affinity, as data.loader_workers counts them)
    prepare_workers: int | Literal["auto"] = "auto"
    # True: the prepared cache is the data; data.root is not read, nor checked against the cache's source
    cache_only: bool = False
    # DataLoader workers during training (they read, crop and pin; augmentation runs on the device). auto: the
    # CPUs of this process's affinity shared by the GPUs (ranks) on the host, one left for the main process
    loader_workers: int | Literal["auto"] = "auto"
    synth: SynthConfig = field(default_factory=SynthConfig)


@dataclass
class ModelConfig:
    # isensee2017 (the paper's); nnU-Net's plain (nnunet) and residual-encoder U-Nets (resenc_m|l|xl, one
    # network: the presets differ in patch and batch); MONAI's segresnet, swinunetr and MedNeXt
    # (mednext_s|b|m|l). Each reads its own
    # keys below (brats_swap/config/networks.py); keys set for another network are ignored with a warning.
    name: Literal["isensee2017", "nnunet", "resenc_m", "resenc_l", "resenc_xl", "segresnet", "swinunetr",
                  "mednext_s", "mednext_b", "mednext_m", "mednext_l"] = "isensee2017"
    in_channels: int = 4  # when not set: the number of data.modalities (the loader derives it)
    base_filters: int = 16
    depth: int = 5
    dropout: float = 0.3  # channel dropout inside context modules
    segmentation_levels: int = 3  # deep-supervision levels summed into the output
    leaky_slope: float = 0.3  # Keras default used by Ellis/IBM; Isensee's own code used 0.01
    seg_layer: Literal["norm_act", "conv"] = "norm_act"  # IBM fork (8,269,579 params) or plain 1³ conv (8,269,561)
    # sigmoid channels: BraTS labels (paper) or regions; softmax: a background channel + the labels, mutually
    # exclusive (nnU-Net's label-trained models; train.loss dice_ce)
    outputs: Literal["labels", "regions", "softmax"] = "labels"
    regions: list[str] = field(default_factory=list)  # region outputs (groups of the table); [] = its default
    # softmax outputs: the table's label values of the channels after the background, in channel order; [] =
    # value order (an imported nnU-Net model keeps its dataset's order)
    label_order: list[int] = field(default_factory=list)
    norm_eps: float = 1e-3  # keras_contrib InstanceNormalization adds eps to the std
    # nnU-Net, SegResNet, SwinUNETR: unset = nnU-Net's BraTS plan (or the MONAI network's BraTS setting)
    # adapted to the cube or patch; lists are per stage.
    features: list[int] = field(default_factory=list)  # channels per stage (swinunetr: [feature_size])
    kernels: list[int] = field(default_factory=list)  # nnU-Net: convolution kernel edge per stage
    strides: list[list[int]] = field(default_factory=list)  # nnU-Net: pooling stride per stage and axis
    blocks: list[int] = field(default_factory=list)  # convs (nnunet) or residual blocks (resenc, segresnet) per stage
    decoder_convs: list[int] = field(default_factory=list)  # nnU-Net: convs per decoder stage
    deep_supervision: bool = True  # nnU-Net, SegResNet: losses at every decoder scale (nnU-Net's weights)
    # nnU-Net: where LeakyReLU(inplace=True) writes after each instance norm. "base": the storage under the
    # norm's output; "view": that output itself (a view), as nnU-Net builds it, whose backward holds three
    # more full-size gradient buffers. The same values and gradients, bitwise (brats_swap/model/networks.py).
    inplace_act: Literal["base", "view"] = "base"
    kernel_size: int = 3  # MedNeXt: the depthwise convolutions' kernel edge, 3 or 5 (the paper's two)


@dataclass
class SwapConfig:
    """Names follow IBM's TFLMS so the paper's four swap configurations are expressible."""

    tensors: int = -1  # n_tensors: -1 = every eligible tensor, N = the first N in forward order
    lookahead: int = 1  # lb: reload a tensor this many blocks before its backward use
    # In the middle of backward (past its first `mid_from_marker` blocks, and until it reaches block
    # `mid_until_block` of the forward's order) reload this many blocks ahead instead, where memory has room
    # between the peaks at both ends of backward. -1: `lookahead` throughout. Only with lookahead >= 1.
    mid_lookahead: int = -1
    mid_from_marker: int = 0
    mid_until_block: int = 0
    include: list[str] = field(default_factory=list)  # module-name globs; empty = every module
    exclude: list[str] = field(default_factory=list)  # module-name globs, e.g. "decoder.*" (synthesis path)
    min_bytes: int = 1 << 20  # smaller saved tensors are never swapped
    compress: Literal["none", "bf16"] = "none"  # bf16 is lossy; off by default
    sync: bool = False  # debug: synchronize after every copy
    # A swapped tensor is released (waiting for its copy) once this many bytes were saved after it. None: a
    # share of memory.budget_gib, else of the card (brats_swap/memory/budget.py: inflight_window_bytes).
    max_inflight_bytes: int | None = None
    emulate_gbs: float | None = None  # CPU only: asynchronous copies over an emulated link of this GB/s
    copy_delay_s: float = 0.0  # test knob: each copy first waits a random 0..copy_delay_s (widens races)


@dataclass
class RecomputeConfig:
    modules: list[str] = field(default_factory=list)  # module-name globs wrapped in non-reentrant checkpointing
    norm_act: bool = False  # keep conv outputs, recompute instance norm + LeakyReLU in backward
    # module-name globs whose norm/act outputs norm_act leaves stored (kept or swapped), e.g. where a copy
    # hides behind compute but a recomputation would cost time (the planner chooses them per tensor)
    norm_act_exclude: list[str] = field(default_factory=list)


@dataclass
class MemoryConfig:
    mode: Literal["none", "swap", "recompute", "hybrid", "auto"] = "none"
    budget_gib: float | None = None  # device-memory budget for `auto` (and the planner's `fits`)
    bandwidth_gbs: float | None = None  # host<->device GB/s for the planner; None = measure
    # GiB a card holds before a step's first tensor (CUDA context, cuDNN workspace, allocator reserve), part of
    # budget_gib; None = the device's default: 2 on a GPU, 0 on a CPU (see brats_swap.memory.budget)
    device_overhead_gib: float | None = None
    swap: SwapConfig = field(default_factory=SwapConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)


@dataclass
class TrainConfig:
    mode: Literal["full", "patch"] = "full"
    patch: list[int] = field(default_factory=lambda: [128, 128, 128])
    patches_per_case: int = 1  # random patches drawn per case per epoch in patch mode
    # share of patches centred on a tumour voxel, or "nnunet": nnU-Net's rule, the last
    # batch - round(0.67 * batch) samples of every batch hold a voxel of a tumour class present in the case
    patch_foreground: float | Literal["nnunet"] = 0.33
    max_epochs: int = 500
    steps_per_epoch: int | None = None  # None = one pass over the training cases
    batch_size: int = 1
    val_batch_size: int = 1
    lr: float = 5e-4
    adam_eps: float = 1e-7  # Keras' Adam epsilon
    weight_decay: float = 0.0
    # sgd: Nesterov, momentum train.momentum (nnU-Net's); adamw: decoupled weight decay (MedNeXt's)
    optimizer: Literal["adam", "sgd", "adamw"] = "adam"
    momentum: float = 0.99  # sgd only
    schedule: Literal["plateau", "poly"] = "plateau"  # poly: lr * (1 - epoch / max_epochs) ** poly_exponent
    poly_exponent: float = 0.9
    # dice: Ellis's weighted Dice; dice_ce: MONAI's DiceCELoss (sigmoid Dice + cross-entropy across the
    # channels, for label outputs); dice_bce: nnU-Net's region loss (sigmoid batch Dice + BCE)
    loss: Literal["dice", "dice_ce", "dice_bce"] = "dice"
    grad_clip: float | None = None  # max global gradient norm (nnU-Net: 12); None = no clipping
    plateau_factor: float = 0.5
    plateau_patience: int = 10
    early_stop_patience: int = 50
    val_fraction: float = 0.2  # held-out fraction when not running cross-validation
    val_every: int = 1  # epochs between validations
    # The training augmentation, run on the device on the whole batch (docs/augmentation.md): a recipe of
    # brats_swap.augment.registry (the loader checks the name against it; cube48 = the paper's).
    augment: str = "cube48"
    amp: Literal["none", "bf16", "fp16"] = "none"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # torch CPU threads; None = torch's default
    deterministic: bool = False  # true: torch deterministic algorithms, no cuDNN benchmark (run/device.py)
    # torch.compile each block of the network (and the loss), the memory engine's hooks at the blocks' edges
    # (docs/memory.md#compiled-steps): auto = on CUDA (as nnU-Net), off on the CPU; a failed compilation runs eager
    compile: bool | Literal["auto"] = "auto"
    # Weights a fold starts from instead of a fresh initialisation: a brats-swap checkpoint file (what
    # `import-nnunet` writes); None = initialise. A --resume continues from the fold's own checkpoint instead.
    init_from: str | None = None


@dataclass
class EvaluateConfig:
    grid: Literal["original", "cube"] = "original"  # where metrics are computed
    sw_overlap: float = 0.5  # sliding-window overlap for patch models
    sw_blend: Literal["gaussian", "constant"] = "gaussian"
    sw_batch_size: int = 1
    # Which inference rules predict follows: "brats_swap" (MONAI's sliding window over data.cube, probabilities
    # blended) or "nnunet" (nnU-Net's: tiles over the non-zero crop, logits blended; written by import-nnunet,
    # brats_swap.evaluate.nnunet_inference). sw_overlap = 1 - nnU-Net's step_size, sw_blend, sw_batch_size apply.
    inference: Literal["brats_swap", "nnunet"] = "brats_swap"
    # The spatial axes (0, 1, 2 = the file's x, y, z) test-time mirroring flips (nnU-Net's allowed mirroring axes).
    mirror_axes: list[int] = field(default_factory=lambda: [0, 1, 2])
    # nnU-Net's rules only: the voxel size in mm (the file's x, y, z) the network predicts at, the nnU-Net plans'
    # spacing (written by import-nnunet): each case is resampled to it and the logits back to the case's voxels
    # (brats_swap.evaluate.nnunet_resampling). null = the case's own voxels.
    resample_spacing: list[float] | None = None
    # nnU-Net's rules only: nnU-Net's axis order, for each axis of its arrays the file's axis (0 x, 1 y, 2 z):
    # SimpleITK's (z, y, x) after the plans' transpose_forward (written by import-nnunet). The resampling runs
    # on these axes, as nnU-Net's does (its float64 sums round in that order).
    nnunet_axes: list[int] = field(default_factory=lambda: [2, 1, 0])
    threshold: float = 0.5
    # predict / evaluate / serve-challenge: compile each block as train.compile does (auto = on CUDA only)
    compile: bool | Literal["auto"] = "auto"
    hd95: bool = True
    save_predictions: bool = True


@dataclass
class CVConfig:
    folds: int = 5
    max_hours: float | None = None


@dataclass
class Config:
    name: str = "default"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    cv: CVConfig = field(default_factory=CVConfig)


# The largest value of each integer key (dotted; a list key bounds each of its items). Far above any real run,
# and low enough that what follows from a value (a batch of volumes, a schedule, a pool of workers, a network
# input) cannot overflow an integer or ask for memory without end: `train.batch_size: 1e30` is refused here, not
# deep inside torch. Every other integer key is bounded by INTEGER_MAGNITUDE. docs/configs.md lists them.
INTEGER_LIMITS: dict[str, int] = {
    "seed": 2**32 - 1,  # numpy's seeds are 32-bit
    "data.cube": 1024,
    "data.prepare_workers": 256,
    "data.loader_workers": 256,
    "data.synth.cases": 100_000,
    "data.synth.shape": 1024,
    "train.patch": 1024,
    "train.batch_size": 1024,
    "train.val_batch_size": 1024,
    "train.patches_per_case": 1024,
    "train.max_epochs": 100_000,
    "train.steps_per_epoch": 10_000_000,
    "train.val_every": 100_000,
    "train.early_stop_patience": 100_000,
    "train.plateau_patience": 100_000,
    "train.threads": 1024,
    "evaluate.sw_batch_size": 1024,
    "cv.folds": 100,
}
INTEGER_MAGNITUDE = 2**53  # integers a float64 holds exactly
