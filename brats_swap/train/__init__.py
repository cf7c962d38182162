"""Training: the explicit loop (`loop.train_fold`), the data pipeline, checkpoints and the loss."""
