"""Typed configuration: schema dataclasses, YAML loading and dotted overrides.

`ConfigError` (defined with the other error types in `brats_swap.errors`) is re-exported here: a bad
setting is a configuration concept, and packages that may only depend on `brats_swap.config` (memory/)
raise it from here.
"""

from brats_swap.config.loader import (
    config_from_saved,
    config_to_dict,
    config_to_yaml,
    diff_configs,
    load_config,
    validate_memory_config,
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
from brats_swap.errors import ConfigError

__all__ = [
    "Config", "CVConfig", "DataConfig", "EvaluateConfig", "MemoryConfig", "ModelConfig", "RecomputeConfig",
    "SwapConfig", "SynthConfig", "TrainConfig", "config_from_saved", "config_to_dict", "config_to_yaml",
    "diff_configs", "load_config",
    "ConfigError", "validate_memory_config",
]
