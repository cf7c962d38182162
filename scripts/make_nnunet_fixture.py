"""Make tests/fixtures/nnunet_results/: a tiny nnU-Net v2 results folder, made by nnU-Net's own code.

Run it with nnunetv2 installed (not in the project's environment: nnU-Net's dependencies are heavy and
some would replace torch), e.g.

    python3 -m venv /tmp/nnunet && /tmp/nnunet/bin/pip install torch==2.13.0 && \
    /tmp/nnunet/bin/pip install --no-deps nnunetv2==2.8.1 dynamic-network-architectures==0.4.4 einops && \
    /tmp/nnunet/bin/pip install acvl-utils batchgenerators batchgeneratorsv2 blosc2 SimpleITK scikit-image \
        scikit-learn scipy pandas matplotlib seaborn tifffile imagecodecs graphviz yacs tqdm requests nibabel rich
    /tmp/nnunet/bin/python scripts/make_nnunet_fixture.py tests/fixtures/nnunet_results

What it does, all with nnU-Net's code: BraTS 2021-named phantoms (brats-swap's) are converted with
nnU-Net's `Dataset137_BraTS21` functions (labels renumbered 1 edema, 2 necrosis, 3 enhancing; regions in
dataset.json), fingerprinted, planned by nnU-Net's `ExperimentPlanner` (with 4 base features and at most
16, so that the checkpoint is a few hundred KB), preprocessed, and trained for one epoch of two iterations
on the CPU by a `nnUNetTrainer` subclass. The results folder's plans.json, dataset.json and
fold_0/checkpoint_final.pth are copied to OUT.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATASET_ID, DATASET = 991, "Dataset991_BraTSPhantoms"
SHAPE = (40, 40, 24)


def main(out: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="nnunet-fixture-"))
    for name in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
        os.environ[name] = str(work / name)
        (work / name).mkdir()
    os.environ.update(nnUNet_n_proc_DA="1", nnUNet_compile="false")
    sys.path.insert(0, str(REPO))
    import torch
    from nnunetv2.dataset_conversion.Dataset137_BraTS21 import (
        copy_BraTS_segmentation_and_convert_labels_to_nnUNet,
    )
    from nnunetv2.dataset_conversion.generate_dataset_json import generate_dataset_json
    from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import ExperimentPlanner
    from nnunetv2.experiment_planning.plan_and_preprocess_api import extract_fingerprints, preprocess
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    from brats_swap.data.phantom import synthesize_dataset

    brats = work / "brats"
    cases = synthesize_dataset(brats, 6, seed=11, edition="2021", shape=SHAPE, id_offset=11000)
    raw = work / "nnUNet_raw" / DATASET
    (raw / "imagesTr").mkdir(parents=True)
    (raw / "labelsTr").mkdir()
    for case in cases:  # as Dataset137_BraTS21.py's main does
        for index, suffix in enumerate(("t1", "t1ce", "t2", "flair")):
            shutil.copy(brats / case / f"{case}_{suffix}.nii.gz", raw / "imagesTr" / f"{case}_{index:04d}.nii.gz")
        copy_BraTS_segmentation_and_convert_labels_to_nnUNet(str(brats / case / f"{case}_seg.nii.gz"),
                                                             str(raw / "labelsTr" / f"{case}.nii.gz"))
    generate_dataset_json(str(raw), channel_names={0: "T1", 1: "T1ce", 2: "T2", 3: "Flair"},
                          labels={"background": 0, "whole tumor": (1, 2, 3), "tumor core": (2, 3),
                                  "enhancing tumor": (3,)},
                          num_training_cases=len(cases), file_ending=".nii.gz", regions_class_order=(1, 2, 3),
                          license="brats-swap phantoms", reference="scripts/make_nnunet_fixture.py",
                          dataset_release="1.0")

    extract_fingerprints([DATASET_ID], num_processes=1)
    planner = ExperimentPlanner(DATASET_ID)
    planner.UNet_base_num_features = 4
    planner.UNet_max_features_3d = 16
    planner.plan_experiment()
    preprocess([DATASET_ID], configurations=("3d_fullres",), num_processes=(1,))

    class nnUNetTrainerTiny(nnUNetTrainer):  # noqa: N801 (nnU-Net's naming)
        def __init__(self, plans: dict, configuration: str, fold: int, dataset_json: dict,
                     device: torch.device = torch.device("cpu")):  # nnU-Net records these arguments by name
            super().__init__(plans, configuration, fold, dataset_json, device)
            self.num_iterations_per_epoch, self.num_val_iterations_per_epoch, self.num_epochs = 2, 1, 1

    from batchgenerators.utilities.file_and_folder_operations import load_json

    preprocessed = work / "nnUNet_preprocessed" / DATASET
    os.environ["nnUNet_n_proc_DA"] = "0"  # augment in this process (the planner above needs a positive count)
    plans = {**load_json(str(preprocessed / "nnUNetPlans.json")), "continue_training": False}  # as run_training
    trainer = nnUNetTrainerTiny(plans=plans, configuration="3d_fullres",
                                fold=0, dataset_json=load_json(str(preprocessed / "dataset.json")),
                                device=torch.device("cpu"))
    trainer.run_training()

    results = work / "nnUNet_results" / DATASET / "nnUNetTrainerTiny__nnUNetPlans__3d_fullres"
    target = out / DATASET / results.name
    (target / "fold_0").mkdir(parents=True, exist_ok=True)
    for name in ("plans.json", "dataset.json", "dataset_fingerprint.json"):
        shutil.copy(results / name, target / name)
    shutil.copy(results / "fold_0" / "checkpoint_final.pth", target / "fold_0" / "checkpoint_final.pth")
    print(f"wrote {target}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "tests" / "fixtures" / "nnunet_results")
