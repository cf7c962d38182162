"""Per case: `brats-swap predict` on an imported nnU-Net run against nnUNetv2's own predictor, same files.

What is measured, for each tool, with test-time mirroring off and on: the CPU time (all threads, the
process's `process_time`) and wall time of predicting one 240x240x155 case from its NIfTI files to the
written segmentation (without mirroring also the same case again in the same process: what each further
case of a folder costs once the first case's one-time work is done), and the process's peak resident memory; the model load (with the tool's imports) is timed
apart, and the memory right after it is reported so the case's own share is visible. Each measurement runs
in a fresh process; the two tools alternate (which goes first flips every repeat) and the median of
`--repeats` is reported, with the machine's load average around each run (other work on the machine shows
up there). The two tools' segmentations are compared too (fraction of equal voxels).

The model: by default an nnU-Net v2 results folder written here in nnU-Net's format (plans.json of a
PlainConvUNet at BraTS's patch 128^3, 6 stages, `--features` base features doubling up to 320, random
weights from nnU-Net's own `get_network_from_plans`; fold_0/checkpoint_final.pth), or `--results DIR` for a
real one. The case: a brats-swap phantom of `--shape` (what `data synth --shape 240 240 155` writes).

    .venv/bin/python scripts/bench_nnunet_predict.py [--repeats 3] [--features 8] [--threads 2]
        [--device cpu|cuda] [--out docs/benchmarks/nnunet_predict.json] [--work DIR [--from-records]]

Needs nnunetv2 (installed with --no-deps by `make install`). `--device cuda` is the mode for a first GPU
run: times with synchronisation and the CUDA peak allocated memory instead of the resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = (REPO / "tests" / "fixtures" / "nnunet_results" / "Dataset991_BraTSPhantoms"
           / "nnUNetTrainerTiny__nnUNetPlans__3d_fullres")
FOLDER = "nnUNetTrainer__nnUNetPlans__3d_fullres"
TOOLS = ("brats-swap", "nnU-Net")
GIB = 1024**3


class FixtureTrainer:
    """What nnU-Net's predictor asks the trainer class for: the network, as nnUNetTrainer's
    `build_network_architecture` builds it (`get_network_from_plans` with these arguments). nnUNetTrainer
    itself is not imported: its module needs seaborn and scikit-learn, for training only."""

    @staticmethod
    def build_network_architecture(plans_manager, configuration_manager, num_input_channels, num_output_channels,
                                   enable_deep_supervision=True):
        from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

        return get_network_from_plans(
            configuration_manager.network_arch_class_name, configuration_manager.network_arch_init_kwargs,
            configuration_manager.network_arch_init_kwargs_req_import, num_input_channels, num_output_channels,
            allow_init=True, deep_supervision=enable_deep_supervision)


def nnunet_predictor(results: Path, *, mirroring: bool, step: float = 0.5, gaussian: bool = True,
                     device: str = "cpu"):
    """nnUNetPredictor (nnUNetv2_predict's settings) on fold 0 of `results`, its trainer's network built by
    `FixtureTrainer` (nnUNetTrainer and the test fixture's subclass build the same)."""
    import torch
    from nnunetv2.inference import predict_from_raw_data

    predictor = predict_from_raw_data.nnUNetPredictor(tile_step_size=step, use_gaussian=gaussian,
                                                      use_mirroring=mirroring, device=torch.device(device),
                                                      allow_tqdm=False)
    find = predict_from_raw_data.recursive_find_trainer_class_by_name
    predict_from_raw_data.recursive_find_trainer_class_by_name = lambda name: FixtureTrainer
    try:
        predictor.initialize_from_trained_model_folder(str(results), use_folds=(0,))
    finally:
        predict_from_raw_data.recursive_find_trainer_class_by_name = find
    return predictor


def write_model_folder(out: Path, features: int) -> Path:
    """An nnU-Net v2 results folder in nnU-Net's format: the fixture's plans and dataset.json with a BraTS-sized
    3d_fullres (patch 128^3, 6 stages), and a checkpoint of nnU-Net's network with its random initialisation."""
    import torch
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    results = out / "Dataset992_BraTSBench" / FOLDER
    (results / "fold_0").mkdir(parents=True, exist_ok=True)
    plans = json.loads((FIXTURE / "plans.json").read_text())
    plans["dataset_name"], plans["plans_name"] = "Dataset992_BraTSBench", "nnUNetPlans"
    entry = plans["configurations"]["3d_fullres"]
    stages = 6
    kwargs = entry["architecture"]["arch_kwargs"]
    kwargs.update(n_stages=stages, features_per_stage=[min(features * 2**i, 320) for i in range(stages)],
                  kernel_sizes=[[3, 3, 3]] * stages, strides=[[1, 1, 1]] + [[2, 2, 2]] * (stages - 1),
                  n_conv_per_stage=[2] * stages, n_conv_per_stage_decoder=[2] * (stages - 1))
    entry.update(patch_size=[128, 128, 128], median_image_size_in_voxels=[140.0, 170.0, 137.0], batch_size=2,
                 spacing=[1.0, 1.0, 1.0])
    (results / "plans.json").write_text(json.dumps(plans, indent=2))
    (results / "dataset.json").write_text((FIXTURE / "dataset.json").read_text())
    manager = PlansManager(plans)
    configuration = manager.get_configuration("3d_fullres")
    torch.manual_seed(features)  # the same weights every time: a kept --work run and a new model folder agree
    network = FixtureTrainer.build_network_architecture(manager, configuration, 4, 3, enable_deep_supervision=True)
    checkpoint = {"network_weights": network.state_dict(), "trainer_name": "nnUNetTrainer",
                  "init_args": {"configuration": "3d_fullres", "fold": 0},
                  "inference_allowed_mirroring_axes": (0, 1, 2), "current_epoch": 0}
    torch.save(checkpoint, results / "fold_0" / "checkpoint_final.pth")
    return results


# ---- one measurement, in its own process ---------------------------------------------------------------------

def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: KiB


def worker(args: argparse.Namespace) -> dict:
    """Load the tool's model (timed), predict the one case from its files (CPU and wall time), report memory.
    Each tool runs as its command would: brats-swap's process set up as its CLI sets it up (huge pages for
    torch's buffers, brats_swap.process_env), nnU-Net's as nnUNetv2_predict leaves it."""
    if args.worker == "brats-swap":
        from brats_swap.process_env import configure_process

        configure_process()
    import torch

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    case = Path(args.case)
    images = [str(case / f"{case.name}_{m}.nii.gz") for m in ("t1", "t1ce", "t2", "flair")]
    out = Path(args.out_dir)
    started = time.perf_counter()
    if args.worker == "nnU-Net":
        predictor = nnunet_predictor(Path(args.results), mirroring=args.tta, device=args.device)

        def run() -> None:
            predictor.predict_from_files_sequential([images], [str(out / case.name)])
    else:
        from brats_swap.evaluate.failures import CaseFailures
        from brats_swap.evaluate.predicting import predict_with, run_predictor

        predictor = run_predictor(Path(args.run), device=args.device, postprocess=False)

        def run() -> None:
            failures = CaseFailures()
            predict_with(predictor, case, out, tta=args.tta, postprocess=False, progress=False, failures=failures)
            failures.raise_if_any("bench", 1)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    load_s = time.perf_counter() - started
    rss_after_load = _peak_rss_gib()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    result = {"tool": args.worker, "tta": args.tta, "load_s": load_s, "predict_cpu_s": time.process_time() - cpu0,
              "predict_wall_s": time.perf_counter() - wall0, "peak_rss_gib": _peak_rss_gib(),
              "peak_rss_after_load_gib": rss_after_load}
    if not args.tta:
        # The same case again in the same process: what each further case of a folder costs, once the first
        # case's one-time work (oneDNN's kernels for these shapes, the Gaussian, first-touch memory) is done.
        cpu0 = time.process_time()
        run()
        if cuda:
            torch.cuda.synchronize()
        result["second_case_cpu_s"] = time.process_time() - cpu0
    if cuda:
        result["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    # Each measurement also lands next to the outputs, so an interrupted run keeps what it measured.
    (out / f"record-{time.time_ns()}.json").write_text(json.dumps(result))
    return result


def measure(tool: str, tta: bool, args: argparse.Namespace, case: Path, results: Path, run: Path,
            out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "nnUNet_def_n_proc": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("nnUNet_raw", str(out)), env.setdefault("nnUNet_preprocessed", str(out))
    env.setdefault("nnUNet_results", str(out))
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", tool, "--case", str(case), "--results",
               str(results), "--run", str(run), "--out-dir", str(out), "--threads", str(args.threads),
               "--device", args.device, *(["--tta"] if tta else [])]
    load_before = os.getloadavg()[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tool} (tta={tta}) failed:\n{done.stderr[-3000:]}")
    line = [text for text in done.stdout.splitlines() if text.startswith("{")][-1]
    return {**json.loads(line), "load_average_before": load_before, "load_average_after": os.getloadavg()[0]}


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for tta in (False, True):
        row = {"tta": tta}
        for tool in TOOLS:
            mine = [r for r in records if r["tool"] == tool and r["tta"] == tta]
            for key in ("predict_cpu_s", "predict_wall_s", "peak_rss_gib", "peak_rss_after_load_gib", "load_s",
                        *(["cuda_peak_allocated_gib"] if "cuda_peak_allocated_gib" in mine[0] else []),
                        *(["second_case_cpu_s"] if "second_case_cpu_s" in mine[0] else [])):
                row[f"{tool}:{key}"] = statistics.median(r[key] for r in mine)
        row["cpu_ratio"] = row["brats-swap:predict_cpu_s"] / row["nnU-Net:predict_cpu_s"]
        if "brats-swap:second_case_cpu_s" in row:
            row["second_case_cpu_ratio"] = row["brats-swap:second_case_cpu_s"] / row["nnU-Net:second_case_cpu_s"]
        row["memory_ratio"] = row["brats-swap:peak_rss_gib"] / row["nnU-Net:peak_rss_gib"]
        rows.append(row)
    return rows


def table(rows: list[dict], repeats: int) -> str:
    lines = ["| TTA | tool | CPU time, first case (s) | CPU time, next case (s) | wall, first case (s) | peak RSS (GiB) | "
             "RSS after model load (GiB) | model load (s) | CPU ratio, first / next case | memory ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for tool in TOOLS:
            second = row.get(f"{tool}:second_case_cpu_s")
            ratios = ("", "")
            if tool == "brats-swap":
                next_ratio = f" / {row['second_case_cpu_ratio']:.2f}" if "second_case_cpu_ratio" in row else ""
                ratios = (f"{row['cpu_ratio']:.2f}{next_ratio}", f"{row['memory_ratio']:.2f}")
            lines.append(f"| {'on' if row['tta'] else 'off'} | {tool} | {row[f'{tool}:predict_cpu_s']:.1f} | "
                         f"{'' if second is None else f'{second:.1f}'} | "
                         f"{row[f'{tool}:predict_wall_s']:.1f} | {row[f'{tool}:peak_rss_gib']:.2f} | "
                         f"{row[f'{tool}:peak_rss_after_load_gib']:.2f} | {row[f'{tool}:load_s']:.2f} | "
                         f"{ratios[0]} | {ratios[1]} |")
    lines.append(f"\nmedians of {repeats} runs each; ratio = brats-swap / nnU-Net")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "nnunet_predict.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--features", type=int, default=8, help="base features of the generated model (nnU-Net: 32)")
    parser.add_argument("--shape", type=int, nargs=3, default=[240, 240, 155])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--results", type=Path, default=None, help="an nnU-Net results folder to use instead")
    parser.add_argument("--work", type=Path, default=None, help="folder for the case, model and outputs")
    parser.add_argument("--from-records", action="store_true", help="only summarise the measurements already "
                        "under --work (those of an interrupted run)")
    parser.add_argument("--worker", choices=TOOLS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tta", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}

    from brats_swap.data.phantom import synthesize_dataset
    from brats_swap.ship.nnunet_import import import_nnunet

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-nnunet-predict-"))
    if args.from_records:
        records = [json.loads(p.read_text()) for p in sorted((work / "out").glob("*/record-*.json"))]
        return report(args, records, None, _agreements(work / "out"), str(args.results or work / "results"))
    work.mkdir(parents=True, exist_ok=True)
    case_id = synthesize_dataset(work / "cases", 1, seed=3, edition="2021", shape=tuple(args.shape))[0]
    case = work / "cases" / case_id
    kept = work / "results" / "Dataset992_BraTSBench" / FOLDER
    results = args.results or (kept if (kept / "fold_0" / "checkpoint_final.pth").is_file()
                               else write_model_folder(work / "results", args.features))
    run = work / "run"
    import_started = time.perf_counter()
    if not (run / "config.yaml").exists():
        import_nnunet(results, run)
    import_s = time.perf_counter() - import_started
    records = []
    for repeat in range(args.repeats):
        for tta in (False, True):
            order = TOOLS if repeat % 2 == 0 else TOOLS[::-1]
            for tool in order:
                record = measure(tool, tta, args, case, results, run, work / "out" / f"{tool}-{tta}")
                records.append({**record, "repeat": repeat})
                print(f"repeat {repeat} tta={tta} {tool}: {record['predict_cpu_s']:.1f} s CPU, "
                      f"{record['peak_rss_gib']:.2f} GiB, load average {record['load_average_before']:.1f}", flush=True)
    return report(args, records, import_s, _agreements(work / "out"), str(results))


def _agreements(out: Path) -> dict:
    """The fraction of voxels where the two tools' segmentations agree, without and with TTA (where both wrote
    one). brats-swap writes the table's values, nnU-Net the dataset's: compared in the dataset's values."""
    agree = {}
    for tta in (False, True):
        ours, theirs = sorted((out / f"brats-swap-{tta}").glob("*.nii.gz")), sorted((out / f"nnU-Net-{tta}").glob("*.nii.gz"))
        if ours and theirs:
            agree[str(tta)] = _agreement_in_dataset_values(ours[0], theirs[0])
    return agree


def report(args: argparse.Namespace, records: list[dict], import_s: float | None, agree: dict,
           results: str) -> dict:
    """Print the table and write the JSON (medians over the repeats that were measured)."""
    from brats_swap.atomic import atomic_write_json

    repeats = min(sum(r["tool"] == tool and r["tta"] == tta for r in records) for tool in TOOLS for tta in (False, True))
    rows = summarize(records)
    text = table(rows, repeats)
    print(text)
    for tta, fraction in agree.items():
        print(f"segmentations equal in {fraction:.5f} of the voxels ({'TTA' if tta == 'True' else 'no TTA'})")
    result = {"settings": {"shape": args.shape, "features": args.features, "threads": args.threads,
                           "device": args.device, "repeats": repeats, "results": results,
                           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
              "import_s": import_s, "rows": rows, "records": records, "labels_equal_fraction": agree,
              "table": text}
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


def _agreement_in_dataset_values(ours: Path, theirs: Path) -> float:
    """brats-swap's labels (2021 table: 1 NCR, 2 ED, 4 ET) mapped to the fixture dataset's (1 ED, 2 NCR, 3 ET)."""
    import nibabel as nib
    import numpy as np

    mapping = np.zeros(256, dtype=np.uint8)
    mapping[[1, 2, 4]] = [2, 1, 3]
    a = mapping[np.asarray(nib.load(str(ours)).dataobj)]
    b = np.asarray(nib.load(str(theirs)).dataobj)
    return float(np.mean(a == b))


if __name__ == "__main__":
    main()
