"""Training: the fold recipe (`loop.train_fold`), the data pipeline, the loss, memory planning and reports."""
