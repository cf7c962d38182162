"""Per case: `brats-swap predict` on an imported nnU-Net run against nnUNetv2's own predictor, same files.

What is measured, for each tool, with test-time mirroring off and on (`--tta`): the CPU time (all threads, the
process's and the children's it waited for) and wall time of predicting 240x240x155 cases from their NIfTI files to the written
segmentations, `--cases N` different cases one after the other in one process: the first case alone (what a
one-case run costs once the model is loaded) and the mean per case over all N (what a folder costs per case,
the first case's one-time work shared); and the process's peak resident memory. The model load (with the
tool's imports) is timed apart, and the memory right after it is reported so the cases' own share is visible.
Each measurement runs in a fresh process; the tools alternate (which goes first flips every repeat) and the
median of `--repeats` is reported, with the machine's load average around each run (other work on the
machine shows up there). The tools' segmentations are compared with nnU-Net's per case (fraction of equal
voxels; tests/test_nnunet_predict.py's bound is 99.9% of the voxels).

`--compile` adds brats-swap with `evaluate.compile: true` (each block of the network under `torch.compile`,
docs/memory.md#compiled-steps) twice: first with an empty compile cache (`TORCHINDUCTOR_CACHE_DIR` under the
work folder, emptied before; its first case includes compiling), then with the cache that run left (a later
`predict` of the same user), and reports what each spent compiling (wall seconds in dynamo and inductor).
Inductor compiles in the measured process (`TORCHINDUCTOR_COMPILE_THREADS=1`), so its CPU time counts.

`--layout`: `sliding` is nnU-Net's sliding window over 128^3 tiles (the plans' patch); `whole` is the same
network with the plans' patch made the whole case (each axis rounded up to the network's 2^5, 256x256x160 for
240x240x155), so that both tools run it once per case on the padded crop: whole-cube prediction under
nnU-Net's rules.

The model: by default an nnU-Net v2 results folder written here in nnU-Net's format (plans.json of a
PlainConvUNet, 6 stages, `--features` base features doubling up to 320, random weights from nnU-Net's own
`get_network_from_plans`; fold_0/checkpoint_final.pth), or `--results DIR` for a real one (sliding layout).
The cases: brats-swap phantoms of `--shape` (what `data synth --shape 240 240 155` writes).

    .venv/bin/python scripts/bench_nnunet_predict.py [--repeats 3] [--features 8] [--threads 2] [--cases 2]
        [--tta off|on|both] [--layout sliding|whole|both] [--compile] [--device cpu|cuda]
        [--out docs/benchmarks/nnunet_predict.json] [--work DIR [--from-records]]

Needs nnunetv2 (installed with --no-deps by `make install`). `--device cuda` is the mode for a first GPU
run: times with synchronisation and the CUDA peak allocated memory instead of the resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
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
EAGER, COLD, WARM, NNUNET = "brats-swap", "brats-swap compiled, cold cache", "brats-swap compiled, warm cache", "nnU-Net"
TOOLS = (EAGER, COLD, WARM, NNUNET)
COMPILED = (COLD, WARM)
LAYOUTS = ("sliding", "whole")
STAGES = 6  # the generated network's stages: 5 poolings, so the whole-cube patch is a multiple of 2^5 per axis
AGREEMENT = 0.999  # tests/test_nnunet_predict.py: labels equal to nnU-Net's on at least 99.9% of the voxels
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


def whole_case_patch(shape) -> list[int]:
    """The plans' patch (nnU-Net's z, y, x) that covers a case of `shape` (x, y, z) in one tile: each axis
    rounded up to a multiple of 2^(stages - 1), as the network's poolings need."""
    step = 2 ** (STAGES - 1)
    return [-(-int(size) // step) * step for size in reversed(shape)]


def write_model_folder(out: Path, features: int, patch=(128, 128, 128)) -> Path:
    """An nnU-Net v2 results folder in nnU-Net's format: the fixture's plans and dataset.json with a BraTS-sized
    3d_fullres (6 stages, `patch` in nnU-Net's axes), and a checkpoint of nnU-Net's network with its random
    initialisation."""
    import torch
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    results = out / "Dataset992_BraTSBench" / FOLDER
    (results / "fold_0").mkdir(parents=True, exist_ok=True)
    plans = json.loads((FIXTURE / "plans.json").read_text())
    plans["dataset_name"], plans["plans_name"] = "Dataset992_BraTSBench", "nnUNetPlans"
    entry = plans["configurations"]["3d_fullres"]
    kwargs = entry["architecture"]["arch_kwargs"]
    kwargs.update(n_stages=STAGES, features_per_stage=[min(features * 2**i, 320) for i in range(STAGES)],
                  kernel_sizes=[[3, 3, 3]] * STAGES, strides=[[1, 1, 1]] + [[2, 2, 2]] * (STAGES - 1),
                  n_conv_per_stage=[2] * STAGES, n_conv_per_stage_decoder=[2] * (STAGES - 1))
    entry.update(patch_size=[int(p) for p in patch], median_image_size_in_voxels=[140.0, 170.0, 137.0],
                 batch_size=2, spacing=[1.0, 1.0, 1.0])
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


def _cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of the children it waited for: inductor builds each compiled
    kernel with a C++ compiler in a child process."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def worker(args: argparse.Namespace) -> dict:
    """Load the tool's model (timed), predict the cases one after the other from their files (CPU and wall time
    of the first and of all), report memory and, compiled, the seconds spent compiling. Each tool runs as its
    command would: brats-swap's process set up as its CLI sets it up (huge pages for torch's buffers,
    brats_swap.process_env), nnU-Net's as nnUNetv2_predict leaves it."""
    if args.worker != NNUNET:
        from brats_swap.process_env import configure_process

        configure_process()
    import torch

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    cases = [Path(case) for case in args.case]
    out = Path(args.out_dir)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    if args.worker == NNUNET:
        predictor = nnunet_predictor(Path(args.results), mirroring=args.mirroring, device=args.device)

        def run(case: Path) -> None:
            images = [str(case / f"{case.name}_{m}.nii.gz") for m in ("t1", "t1ce", "t2", "flair")]
            predictor.predict_from_files_sequential([images], [str(out / case.name)])
    else:
        from brats_swap.evaluate.failures import CaseFailures
        from brats_swap.evaluate.predicting import predict_with, run_predictor, with_evaluate_settings

        predictor = run_predictor(Path(args.run), device=args.device, postprocess=False)
        if args.worker in COMPILED:  # as `predict --set evaluate.compile=true`
            predictor = with_evaluate_settings(predictor, ["evaluate.compile=true"])

        def run(case: Path) -> None:
            failures = CaseFailures()
            predict_with(predictor, case, out, tta=args.mirroring, postprocess=False, progress=False, failures=failures)
            failures.raise_if_any("bench", 1)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    load_s = time.perf_counter() - started
    rss_after_load = _peak_rss_gib()
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    first: dict[str, float] = {}
    for case in cases:
        run(case)
        if cuda:
            torch.cuda.synchronize()
        if not first:
            first = {"first_case_cpu_s": _cpu_seconds() - cpu0, "first_case_wall_s": time.perf_counter() - wall0,
                     "first_case_compile_s": _compile_seconds()}
    result = {"tool": args.worker, "tta": args.mirroring, "layout": args.layout, "cases": len(cases), "load_s": load_s,
              **first, "per_case_cpu_s": (_cpu_seconds() - cpu0) / len(cases),
              "per_case_wall_s": (time.perf_counter() - wall0) / len(cases), "compile_s": _compile_seconds(),
              "peak_rss_gib": _peak_rss_gib(), "peak_rss_after_load_gib": rss_after_load,
              "load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    if cuda:
        result["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    # Each measurement also lands next to the outputs, so an interrupted run keeps what it measured.
    (out / f"record-{time.time_ns()}.json").write_text(json.dumps(result))
    return result


def _compile_seconds() -> float:
    """What this process spent in dynamo and inductor so far (0 eager)."""
    from brats_swap.run.compiling import compile_seconds_so_far

    return compile_seconds_so_far()


def measure(tool: str, tta: bool, layout: str, args: argparse.Namespace, cases: list[Path], results: Path, run: Path,
            out: Path, cache: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "nnUNet_def_n_proc": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TORCHINDUCTOR_CACHE_DIR": str(cache),
           # inductor compiles in this process, not in a pool of worker processes that outlive the measurement
           # (whose CPU time would not be counted): the compiled rows' CPU time includes compiling.
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    env.setdefault("nnUNet_raw", str(out)), env.setdefault("nnUNet_preprocessed", str(out))
    env.setdefault("nnUNet_results", str(out))
    if tool == COLD:
        shutil.rmtree(cache, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", tool, "--case", *map(str, cases),
               "--results", str(results), "--run", str(run), "--out-dir", str(out), "--threads", str(args.threads),
               "--device", args.device, "--layout", layout, *(["--mirroring"] if tta else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tool} ({layout}, tta={tta}) failed:\n{done.stderr[-3000:]}")
    line = [text for text in done.stdout.splitlines() if text.startswith("{")][-1]
    return json.loads(line)


# ---- the table -------------------------------------------------------------------------------------------------

KEYS = ("first_case_cpu_s", "per_case_cpu_s", "first_case_wall_s", "per_case_wall_s", "first_case_compile_s",
        "compile_s", "peak_rss_gib", "peak_rss_after_load_gib", "load_s")


def summarize(records: list[dict]) -> list[dict]:
    """Per layout, TTA and tool: the medians over the repeats, and the CPU ratios to nnU-Net's."""
    rows = []
    for layout in LAYOUTS:
        for tta in (False, True):
            theirs = [r for r in records if r["tool"] == NNUNET and r["tta"] == tta and r["layout"] == layout]
            for tool in TOOLS:
                mine = [r for r in records if r["tool"] == tool and r["tta"] == tta and r["layout"] == layout]
                if not mine:
                    continue
                row = {"layout": layout, "tta": tta, "tool": tool, "cases": mine[0]["cases"], "repeats": len(mine)}
                for key in (*KEYS, *(["cuda_peak_allocated_gib"] if "cuda_peak_allocated_gib" in mine[0] else [])):
                    row[key] = statistics.median(r[key] for r in mine)
                if theirs and tool != NNUNET:
                    for key in ("first_case_cpu_s", "per_case_cpu_s"):
                        row[f"{key}_ratio"] = row[key] / statistics.median(r[key] for r in theirs)
                rows.append(row)
    return rows


def table(rows: list[dict], agree: dict) -> str:
    lines = ["| layout | TTA | tool | CPU s, first case | CPU s per case over N | N | compiling s (first case) | "
             "wall s, first case | peak RSS (GiB) | model load (s) | CPU × nnU-Net, first / per case | "
             "labels = nnU-Net's (lowest case) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = (f"{row['first_case_cpu_s_ratio']:.2f} / {row['per_case_cpu_s_ratio']:.2f}"
                 if "per_case_cpu_s_ratio" in row else "")
        fraction = agree.get(_agreement_key(row["layout"], row["tta"], row["tool"]))
        lines.append(f"| {row['layout']} | {'on' if row['tta'] else 'off'} | {row['tool']} | "
                     f"{row['first_case_cpu_s']:.1f} | {row['per_case_cpu_s']:.1f} | {row['cases']} | "
                     f"{row['first_case_compile_s']:.1f} | {row['first_case_wall_s']:.1f} | {row['peak_rss_gib']:.2f} | "
                     f"{row['load_s']:.2f} | {ratio} | {'' if fraction is None else f'{fraction:.5f}'} |")
    lines.append("\nmedians of the repeats (each row's own count in the JSON); ratio = the row's tool / nnU-Net")
    return "\n".join(lines)


# ---- the run ---------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "nnunet_predict.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--features", type=int, default=8, help="base features of the generated model (nnU-Net: 32)")
    parser.add_argument("--shape", type=int, nargs=3, default=[240, 240, 155])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", type=int, default=2, help="different cases predicted one after the other in "
                        "each process (the first is also timed alone)")
    parser.add_argument("--tta", choices=("off", "on", "both"), default="both")
    parser.add_argument("--layout", choices=(*LAYOUTS, "both"), default="sliding")
    parser.add_argument("--compile", action="store_true", help="also brats-swap with evaluate.compile=true, "
                        "from an empty and from a warm compile cache")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--results", type=Path, default=None, help="an nnU-Net results folder to use instead "
                        "(sliding layout)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the cases, models and outputs")
    parser.add_argument("--from-records", action="store_true", help="only summarise the measurements already "
                        "under --work (those of an interrupted run)")
    parser.add_argument("--worker", choices=TOOLS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--case", nargs="+", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mirroring", action="store_true", help=argparse.SUPPRESS)  # the worker's TTA
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    layouts = LAYOUTS if args.layout == "both" else (args.layout,)
    if args.results is not None and layouts != ("sliding",):
        parser.error("--results: a results folder is measured with --layout sliding (its own patch)")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-nnunet-predict-"))
    if args.from_records:
        records = [json.loads(p.read_text()) for p in sorted(work.glob("*/out/*/record-*.json"))]
        return report(args, records, _agreements(work, layouts), {})
    work.mkdir(parents=True, exist_ok=True)
    cases = _cases(work / "cases", args.cases, args.shape)
    tools = TOOLS if args.compile else (EAGER, NNUNET)
    ttas = {"off": (False,), "on": (True,), "both": (False, True)}[args.tta]
    records, models = [], {}
    for layout in layouts:
        results, run, import_s = _model(work / layout, layout, args)
        models[layout] = {"results": str(results), "import_s": import_s}
        for repeat in range(args.repeats):
            for tta in ttas:
                order = tools if repeat % 2 == 0 else _flipped(tools)
                for tool in order:
                    record = measure(tool, tta, layout, args, cases, results, run,
                                     work / layout / "out" / f"{tool}-{tta}", work / "inductor")
                    records.append({**record, "repeat": repeat})
                    print(f"{layout} repeat {repeat} tta={tta} {tool}: first case {record['first_case_cpu_s']:.1f} s "
                          f"CPU ({record['first_case_compile_s']:.1f} s compiling), {record['per_case_cpu_s']:.1f} s "
                          f"per case over {record['cases']}, {record['peak_rss_gib']:.2f} GiB, load average "
                          f"{record['load_average_before']:.1f}", flush=True)
    return report(args, records, _agreements(work, layouts), models)


def _flipped(tools: tuple[str, ...]) -> tuple[str, ...]:
    """The order of the odd repeats: nnU-Net and eager brats-swap swap places; the compiled runs stay where they
    are, the cold cache before the warm one."""
    swap = {EAGER: NNUNET, NNUNET: EAGER}
    return tuple(swap.get(tool, tool) for tool in tools)


def _cases(folder: Path, count: int, shape) -> list[Path]:
    """`count` phantom cases of `shape` under `folder` (kept ones reused: each case is drawn from seed 3 and its
    number, the same every time)."""
    from brats_swap.data.phantom import synthesize_dataset

    wanted = [folder / f"BraTS2021_{k:05d}" for k in range(count)]
    if not all((case / f"{case.name}_flair.nii.gz").is_file() for case in wanted):
        synthesize_dataset(folder, count, seed=3, edition="2021", shape=tuple(shape))
    return wanted


def _model(folder: Path, layout: str, args: argparse.Namespace) -> tuple[Path, Path, float | None]:
    """The layout's nnU-Net results folder (written once, or --results) and its import (once)."""
    from brats_swap.ship.nnunet_import import import_nnunet

    patch = (128, 128, 128) if layout == "sliding" else whole_case_patch(args.shape)
    kept = folder / "results" / "Dataset992_BraTSBench" / FOLDER
    results = args.results or (kept if (kept / "fold_0" / "checkpoint_final.pth").is_file()
                               else write_model_folder(folder / "results", args.features, patch))
    run = folder / "run"
    if (run / "config.yaml").exists():
        return results, run, None
    started = time.perf_counter()
    import_nnunet(results, run)
    return results, run, time.perf_counter() - started


def _agreement_key(layout: str, tta: bool, tool: str) -> str:
    return f"{layout} {'tta' if tta else 'no tta'} {tool}"


def _agreements(work: Path, layouts) -> dict:
    """Per layout, TTA and brats-swap variant: the lowest fraction, over the cases, of voxels where its
    segmentation and nnU-Net's agree. brats-swap writes the table's values, nnU-Net the dataset's: compared in
    the dataset's values."""
    agree = {}
    for layout in layouts:
        for tta in (False, True):
            theirs = work / layout / "out" / f"{NNUNET}-{tta}"
            for tool in (EAGER, *COMPILED):
                ours = work / layout / "out" / f"{tool}-{tta}"
                pairs = [(path, theirs / path.name) for path in sorted(ours.glob("*.nii.gz"))
                         if (theirs / path.name).is_file()]
                if pairs:
                    agree[_agreement_key(layout, tta, tool)] = min(_agreement_in_dataset_values(a, b) for a, b in pairs)
    return agree


def report(args: argparse.Namespace, records: list[dict], agree: dict, models: dict) -> dict:
    """Print the table and write the JSON (medians over the repeats that were measured)."""
    from brats_swap.atomic import atomic_write_json

    rows = summarize(records)
    text = table(rows, agree)
    print(text)
    below = {key: fraction for key, fraction in agree.items() if fraction < AGREEMENT}
    for key, fraction in below.items():
        print(f"{key}: labels equal to nnU-Net's in {fraction:.5f} of a case's voxels, below {AGREEMENT}")
    result = {"settings": {"shape": args.shape, "features": args.features, "threads": args.threads,
                           "cases": args.cases, "tta": args.tta, "layout": args.layout, "compile": args.compile,
                           "device": args.device, "repeats": args.repeats, "models": models,
                           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
              "rows": rows, "records": records, "labels_equal_fraction": agree,
              "within_agreement": not below, "table": text}
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
