"""A run folder remembers how it was made: `RUN/config.yaml` is the run's config.

`run_config` is what every command that writes into an existing run folder resolves its config with: `cv`,
`train` (a new fold or `--resume`), `evaluate --run` and the SLURM job scripts (the CLI's `run_and_config`). Without `--config`, an existing `R/config.yaml` is the base (plus any `--set`). Whatever the call
gives that differs from the recorded config is checked against what the run has already trained:

- keys that change what was trained (the model, the data, the folds, the seed) are refused with a one-line
  error once any fold has a checkpoint (train those in a new run folder);
- any other change (more epochs, a window, evaluation settings, the device, the memory policy) is recorded
  in `R/config.yaml` and printed, so the next plain call (cron, a requeued job) uses it too: the line says
  that it reaches every later call and fold (also after `train --fold 1 --set ...`), and which folds finished
  training with the old value.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from brats_swap.atomic import atomic_write_text
from brats_swap.config import Config, config_to_dict, config_to_yaml, diff_configs, load_config
from brats_swap.cv.fold_progress import DONE, TRAINED, fold_standing
from brats_swap.cv.lock import shared_files
from brats_swap.errors import ConfigError
from brats_swap.run.folder import RunFolder

# Keys under model./data. that say where the data lives or how many processes read and prepare it, not what it
# is: the prepared arrays are the same with any number of preparing processes (tests/test_data_cache.py).
DATA_LOCATION_KEYS = frozenset({"data.root", "data.cache", "data.loader_workers", "data.prepare_workers"})


def changes_what_was_trained(key: str) -> bool:
    """True for a dotted config key whose change would make the run's checkpoints mean something else."""
    if key in DATA_LOCATION_KEYS:
        return False
    return key.startswith(("model.", "data.")) or key in ("cv.folds", "seed")


def has_trained(run: RunFolder) -> bool:
    return any(run.root.glob("fold_*/checkpoint_*.pt"))


def _value(config_dict: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config_dict = config_dict[part]
    return config_dict


def run_config(run_dir: RunFolder | Path, config_path: Path | None, overrides: list[str] | None,
               say: Callable[[str], None] | None = None,
               load: Callable[[Path | None, list[str]], Config] = load_config) -> Config:
    """The config of a call on `run_dir` (see the module docstring); records a harmless change, refuses the
    others with ConfigError naming the keys. Without a recorded config, `config_path` + `overrides` as given.
    `load` resolves the call's config (the CLI's also fills `data.modalities` from the data's challenge, as the
    first call that wrote the recorded one did)."""
    run = RunFolder.of(run_dir)
    if not run.config.is_file():
        return load(config_path, overrides or [])
    recorded = load_config(run.config, [])
    config = load(config_path if config_path is not None else run.config, overrides or [])
    changed = diff_configs(recorded, config)
    if not changed:
        return config
    refused = [key for key in changed if changes_what_was_trained(key)]
    if refused and has_trained(run):
        raise ConfigError(f"{run.config}: {', '.join(refused)} differs from the run's config and would change what "
                          "its checkpoints were trained with; train it in a new --run folder")
    old, new = config_to_dict(recorded), config_to_dict(config)
    with shared_files(run):
        atomic_write_text(run.config, config_to_yaml(config))
    if say is not None:
        say(f"{run.config}: recorded " + ", ".join(f"{key} {_value(old, key)!r} -> {_value(new, key)!r}"
                                                    for key in changed) + _applies_to(run))
    return config


def _applies_to(run: RunFolder) -> str:
    """What a recorded change reaches: every later call on the run, whatever fold this one names (a `train
    --fold 1 --set` too); the folds that finished training keep what they were trained with."""
    finished = [k for k in run.existing_folds() if fold_standing(run, k).stage in (DONE, TRAINED)]
    text = "; every later call on this run uses it, for each of its folds, not only this call's"
    if finished:
        text += (f" ({'fold' if len(finished) == 1 else 'folds'} {', '.join(map(str, finished))} finished training "
                 "with the old value: the run's folds then differ, which `export` names)")
    return text


__all__ = ["DATA_LOCATION_KEYS", "changes_what_was_trained", "run_config"]
