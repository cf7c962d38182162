"""The optimiser, learning-rate schedule and gradient clipping of `train.*`.

adam (the paper's: Keras' epsilon, `train.weight_decay`) or sgd (nnU-Net's: Nesterov momentum
`train.momentum` 0.99, weight decay 3e-5 in its configs) or adamw (MedNeXt's: decoupled weight decay, epsilon
`train.adam_eps`). The schedule is plateau (the paper's
ReduceLROnPlateau on the validation loss) or poly (nnU-Net's PolyLR: lr * (1 - epoch / max_epochs) ** 0.9,
stepped once per epoch). `train.grad_clip` bounds the global gradient norm (nnU-Net clips at 12), on the
unscaled gradients under fp16 AMP.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from brats_swap.config import TrainConfig

Scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau | torch.optim.lr_scheduler.PolynomialLR


def build_optimizer(parameters: Iterable[torch.nn.Parameter], train_cfg: TrainConfig) -> torch.optim.Optimizer:
    if train_cfg.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=train_cfg.lr, momentum=train_cfg.momentum, nesterov=True,
                               weight_decay=train_cfg.weight_decay)
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=train_cfg.lr, eps=train_cfg.adam_eps,
                                 weight_decay=train_cfg.weight_decay)
    return torch.optim.Adam(parameters, lr=train_cfg.lr, eps=train_cfg.adam_eps, weight_decay=train_cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig) -> Scheduler:
    if train_cfg.schedule == "poly":
        return torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=train_cfg.max_epochs,
                                                     power=train_cfg.poly_exponent)
    # Keras reduces when `wait >= patience`, torch when `bad_epochs > patience`: patience - 1 matches Keras.
    return torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=train_cfg.plateau_factor,
        patience=max(0, train_cfg.plateau_patience - 1), threshold=1e-4, threshold_mode="abs")


def step_after_validation(scheduler: Scheduler, val_loss: float) -> None:
    """The plateau schedule watches the validation loss."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(val_loss)


def step_after_epoch(scheduler: Scheduler) -> None:
    """The poly schedule follows the epoch count."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step()


def clip_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   max_norm: float | None) -> None:
    """Clip the global gradient norm to `max_norm` (no-op when None), after unscaling fp16 gradients."""
    if max_norm is None:
        return
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
