"""Trained models crossing the run folder's edge.

- out: the bundle (`bundle`: export, and `predict --model` reading one back), the BraTS challenge image
  (`container`) and its entrypoint (`serve`, with `time_budget` and `writable_folders`), the organisers'
  checks of an output folder (`submission`);
- in: an nnU-Net v2 results folder as a run folder (`nnunet_import`), and the image retraining itself on the
  organisers' data (`retrain`).
"""
