"""A trained fold as a ready model: the run's config and a checkpoint's weights.

Evaluation and prediction load models this way (and fold ensembles will); the architecture comes from the
checkpoint's own config, so a run whose `config.yaml` was edited afterwards still loads.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from brats_swap.config import Config, ModelConfig, config_from_saved
from brats_swap.config.inference import inference_config
from brats_swap.errors import CheckpointError, ConfigError
from brats_swap.memory import cuda_device
from brats_swap.model import build_model
from brats_swap.model.pricing import priced_network, weights_mismatch
from brats_swap.model.targets import run_output_count
from brats_swap.run.checkpoint import load_checkpoint, load_latest
from brats_swap.run.compiling import compile_for_inference
from brats_swap.run.console import warn
from brats_swap.run.device import resolve_device
from brats_swap.run.folder import FoldFolder, RunFolder


def load_run_config(run: RunFolder | Path) -> Config:
    """The resolved config a run was trained with (`<run>/config.yaml`)."""
    folder = RunFolder.of(run)
    if not folder.config.is_file():
        raise ConfigError(f"{folder.config}: not found; is {folder.root} a brats-swap run folder?")
    return config_from_saved(yaml.safe_load(folder.config.read_text(encoding="utf-8")) or {})


def load_trained_model(run: RunFolder | Path, fold: int, checkpoint: str = "best",
                       device: torch.device | None = None) -> tuple[torch.nn.Module, Config, dict[str, Any]]:
    """The model of `fold_<k>/checkpoint_<best|latest>.pt` (or of a checkpoint file path), in eval mode.

    Returns (model, the checkpoint's config, the checkpoint state).
    """
    folder = RunFolder.of(run).fold(fold)
    state = _checkpoint_state(folder, checkpoint)
    trained_config = config_from_saved(state["config"])
    if "edition" not in state:
        raise CheckpointError(f"{folder.root}: checkpoint {checkpoint!r} does not record the label table it was "
                              "trained on (no 'edition' entry); it was not written by brats-swap train")
    # The output channels follow the table the fold was trained on (e.g. 4 regions for PED, 1 for MEN-RT).
    model = trained_model(trained_config.model, state["edition"], state["model"],
                          weights_source=f"{folder.root}: checkpoint {checkpoint!r}", device=device)
    return model, trained_config, state


def trained_model(model_cfg: ModelConfig, table: str, weights: Mapping[str, object], *, weights_source: str | Path,
                  config_source: str | Path | None = None, device: torch.device | None = None) -> torch.nn.Module:
    """The network of a fold's `model_cfg` for label table `table`, holding `weights`, in eval mode on `device`
    (default CPU): the one loader of run folders, bundles and imported nnU-Net models.

    The output channels follow `model.outputs`/`model.regions` on `table` (ConfigError naming `model.regions`
    when they do not fit it). The network is first priced on the meta device (`priced_network`: refused above
    the parameters brats-swap builds from a file, naming `config_source`, the file that described it, or
    `weights_source`) and `weights` compared to it, so weights that do not fit are refused in one line naming
    `weights_source` before the real network is allocated."""
    out_channels = run_output_count(table, model_cfg)
    described_by = weights_source if config_source is None else config_source
    expected = priced_network(model_cfg, out_channels, described_by)
    mismatch = weights_mismatch(expected, weights)
    if mismatch is None:
        model = build_model(model_cfg, out_channels=out_channels)
        try:
            model.load_state_dict(weights)
        except RuntimeError as exc:
            mismatch = str(exc).strip().splitlines()[0]
    if mismatch is not None:
        of = "" if config_source is None else f" of {config_source}"
        raise CheckpointError(f"{weights_source}: weights do not match model {model_cfg.name}{of} "
                              f"({model_cfg.in_channels} channel(s), {out_channels} output(s)): {mismatch}")
    return model.to(device or torch.device("cpu")).eval()


CHECKPOINT_NAMES = ("best", "latest")  # what --checkpoint names; anything else is a checkpoint file's path


def check_checkpoint_choice(checkpoint: str) -> None:
    """ConfigError in one line when `checkpoint` (--checkpoint) is neither a name of CHECKPOINT_NAMES nor an
    existing file: a mistyped name lists the valid names (and the closest one), not a missing file."""
    if checkpoint in CHECKPOINT_NAMES or Path(checkpoint).is_file():
        return
    close = difflib.get_close_matches(checkpoint, CHECKPOINT_NAMES, n=1)
    guess = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"--checkpoint {checkpoint!r}: not a checkpoint name nor a file ({guess}expected "
                      f"{' or '.join(CHECKPOINT_NAMES)}, or the path of a checkpoint file)")


def _checkpoint_state(folder: FoldFolder, checkpoint: str) -> dict[str, Any]:
    """`best`, `latest` (falling back to the previous file) or the checkpoint file at path `checkpoint`."""
    check_checkpoint_choice(checkpoint)
    if checkpoint == "best":
        return load_checkpoint(folder.best)
    if checkpoint == "latest":
        loaded = load_latest(folder, warn=warn)
        if loaded is None:
            raise CheckpointError(f"{folder.latest}: checkpoint not found; train the fold first")
        return loaded[0]
    return load_checkpoint(Path(checkpoint))


def load_for_inference(run: RunFolder | Path, fold: int, checkpoint: str,
                       current: Config) -> tuple[torch.nn.Module, Config, torch.device]:
    """A trained fold ready to predict: the model on `current`'s device, the config to predict with
    (`inference_config`) and that device."""
    device = resolve_device(current.train.device)
    # On cuda:N the tiles, the sums and library handles must go to that card, not to GPU 0 (someone else's).
    cuda_device.use_device(device)
    model, trained_config, _ = load_trained_model(run, fold, checkpoint, device)
    compile_for_inference(model, current.evaluate.compile, device)
    return model, inference_config(trained_config, current), device
