"""The named memory policies, as data: the IBM paper's four swap configurations, block checkpointing,
norm_act and hybrid.

Each preset is the `memory:` section of a YAML config. The repository's `configs/<name>.yaml` files hold
the same sections for `brats-swap train --config configs/<name>.yaml` (a test keeps them equal), but the
planner, the benchmarks and the tests read them from here, so an installed package has them too.

A preset names only what makes it that policy. `named_policies(base)` lays each one over the knobs of
`base` that are not a matter of policy (`budget_gib`, `bandwidth_gbs`, `swap.min_bytes`,
`swap.max_inflight_bytes`, and the link knobs `swap.emulate_gbs`, `swap.copy_delay_s`); everything else
starts from the schema defaults.
"""

from __future__ import annotations

from dataclasses import asdict

from brats_swap.config import MemoryConfig
from brats_swap.config.loader import from_dict

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


def preset_policy(name: str, base: MemoryConfig | None = None) -> MemoryConfig:
    """Preset `name` laid over `base`'s non-policy knobs (see the module docstring)."""
    base = base or MemoryConfig()
    section = PRESETS[name]
    swap = {"min_bytes": base.swap.min_bytes, "max_inflight_bytes": base.swap.max_inflight_bytes,
            "emulate_gbs": base.swap.emulate_gbs, "copy_delay_s": base.swap.copy_delay_s,
            **section.get("swap", {})}
    return from_dict(MemoryConfig, {"mode": section["mode"], "budget_gib": base.budget_gib,
                                    "bandwidth_gbs": base.bandwidth_gbs, "swap": swap,
                                    "recompute": dict(section.get("recompute", {}))}, prefix="memory")


def named_policies(base: MemoryConfig | None = None) -> dict[str, MemoryConfig]:
    """`none` (`base` with mode none) and every preset over `base`, in the planner's table order."""
    base = base or MemoryConfig()
    policies = {"none": from_dict(MemoryConfig, {**asdict(base), "mode": "none"}, prefix="memory")}
    policies.update((name, preset_policy(name, base)) for name in PRESET_NAMES)
    return policies
