"""The named memory policies, as data: the IBM paper's four swap configurations, block checkpointing,
norm_act and hybrid.

Each preset is the `memory:` section of a YAML config. The repository's `configs/<name>.yaml` files hold
the same sections for `brats-swap train --config configs/<name>.yaml` (a test keeps them equal), but the
planner, the benchmarks and the tests read them from here, so an installed package has them too.

A preset names only what makes it that policy. `named_policies(base)` lays each one over the knobs of
`base` that are not a matter of policy (`budget_gib`, `bandwidth_gbs`, `device_overhead_gib`,
`swap.min_bytes`, `swap.max_inflight_bytes`, and the link knobs `swap.emulate_gbs`, `swap.copy_delay_s`);
everything else starts from the schema defaults.

`PRESETS` spells the module globs with the default U-Net's names. The policies apply to any network:
`resolve_presets(model, input_shape)` writes each preset's rule ("the encoder's two high-resolution
stages", "every stage", "the decoder") in the given model's own module names (`stages.model_stages`),
and the planner prices those. On the default U-Net the resolved globs match the same modules as
`PRESETS` (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict

from torch import nn

from brats_swap.config import MemoryConfig
from brats_swap.config.loader import from_dict
from brats_swap.memory.stages import decoder_globs, encoder_globs, model_stages

PRESETS: dict[str, dict] = {
    # TFLMS n_tensors=-1, lb=1: every eligible saved storage goes to host memory.
    "swap_all": {"mode": "swap", "swap": {"tensors": -1, "lookahead": 1}},
    # TFLMS n_tensors=N: the first N eligible storages in forward order; at 192³ the first 18 are encoder
    # levels 0 and 1, produced first and used last in backward.
    "swap_first_n": {"mode": "swap", "swap": {"tensors": 18, "lookahead": 1}},
    # Everything but the synthesis path, whose tensors backward needs first.
    "swap_no_decoder": {"mode": "swap", "swap": {"tensors": -1, "exclude": ["decoder.*"], "lookahead": 1}},
    # The same, each reload issued three blocks ahead.
    "swap_no_decoder_lookahead": {"mode": "swap", "swap": {"tensors": -1, "exclude": ["decoder.*"],
                                                           "lookahead": 3}},
    # The paper's recomputation baseline: every U-Net level under non-reentrant checkpointing.
    "recompute": {"mode": "recompute", "recompute": {"modules": ["encoder.level*", "decoder.level*"]}},
    # Keep convolution outputs, rebuild instance norm and LeakyReLU outputs in backward.
    "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}},
    # norm_act everywhere, and swap the stored convolution outputs of the two high-resolution levels.
    "hybrid": {"mode": "hybrid", "swap": {"include": ["encoder.level0", "encoder.level1"], "lookahead": 2},
               "recompute": {"norm_act": True}},
}
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


def resolve_presets(model: nn.Module, input_shape: Sequence[int], step: Callable | None = None) -> dict[str, dict]:
    """`PRESETS` with every module glob replaced by the modules of `model` that its rule names: the
    encoder's two highest-resolution stages (hybrid's swap), the decoder (the swap_no_decoder presets'
    exclusion), every stage (recompute's checkpointing). `input_shape` is (B, C, *spatial); `step` as
    in `stages.model_stages`."""
    stages = model_stages(model, input_shape, step)
    every_stage = [g for stage in stages for g in stage.globs]
    no_decoder = {"tensors": -1, "exclude": decoder_globs(stages)}
    return {
        **PRESETS,
        "swap_no_decoder": {"mode": "swap", "swap": {**no_decoder, "lookahead": 1}},
        "swap_no_decoder_lookahead": {"mode": "swap", "swap": {**no_decoder, "lookahead": 3}},
        "recompute": {"mode": "recompute", "recompute": {"modules": every_stage}},
        "hybrid": {"mode": "hybrid", "swap": {"include": encoder_globs(stages, levels=2), "lookahead": 2},
                   "recompute": {"norm_act": True}},
    }


def preset_policy(name: str, base: MemoryConfig | None = None, sections: dict[str, dict] | None = None,
                  ) -> MemoryConfig:
    """Preset `name` of `sections` (default `PRESETS`) laid over `base`'s non-policy knobs (see the module
    docstring)."""
    base = base or MemoryConfig()
    section = (sections or PRESETS)[name]
    swap = {"min_bytes": base.swap.min_bytes, "max_inflight_bytes": base.swap.max_inflight_bytes,
            "emulate_gbs": base.swap.emulate_gbs, "copy_delay_s": base.swap.copy_delay_s,
            **section.get("swap", {})}
    return from_dict(MemoryConfig, {"mode": section["mode"], "budget_gib": base.budget_gib,
                                    "bandwidth_gbs": base.bandwidth_gbs,
                                    "device_overhead_gib": base.device_overhead_gib, "swap": swap,
                                    "recompute": dict(section.get("recompute", {}))}, prefix="memory")


def named_policies(base: MemoryConfig | None = None, sections: dict[str, dict] | None = None,
                   ) -> dict[str, MemoryConfig]:
    """`none` (`base` with mode none) and every preset of `sections` (default `PRESETS`; a model's own:
    `resolve_presets`) over `base`, in the planner's table order."""
    base = base or MemoryConfig()
    policies = {"none": from_dict(MemoryConfig, {**asdict(base), "mode": "none"}, prefix="memory")}
    policies.update((name, preset_policy(name, base, sections)) for name in PRESET_NAMES)
    return policies
