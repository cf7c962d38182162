"""Typed configuration: schema dataclasses, YAML loading and dotted overrides."""

from brats_swap.config.loader import (
    config_from_saved,
    config_to_dict,
    config_to_yaml,
    diff_configs,
    load_config,
)
from brats_swap.config.schema import (
    Config,
    CVConfig,
    DataConfig,
    EvaluateConfig,
    MemoryConfig,
    ModelConfig,
    RecomputeConfig,
    SwapConfig,
    SynthConfig,
    TrainConfig,
)

__all__ = [
    "Config", "CVConfig", "DataConfig", "EvaluateConfig", "MemoryConfig", "ModelConfig", "RecomputeConfig",
    "SwapConfig", "SynthConfig", "TrainConfig", "config_from_saved", "config_to_dict", "config_to_yaml",
    "diff_configs", "load_config",
]
