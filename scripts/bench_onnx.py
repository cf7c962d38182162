"""What deploying without torch saves: the installed size of the two serving environments and the CPU time per
BraTS-sized case (240x240x155, four modalities) of `predict --runtime torch` and `--runtime onnxruntime`, for a
whole-volume model (one network call per case) and a sliding-window one.

    python scripts/bench_onnx.py --out bench_onnx.json [--cube 128] [--patch 64] [--base-filters 8] [--venv DIR]

- Sizes: the bytes of the installed files (each distribution's RECORD) of what each runtime's image installs,
  read from this environment: brats-swap's requirements with torch and its own requirements (the torch image),
  and `ship.container.ONNX_RUNTIME_ROOTS` with theirs (the onnxruntime image, CPU build of onnxruntime here);
  `--venv DIR` adds `du` of a real environment (e.g. a throwaway venv holding only the onnxruntime image's
  requirements).
- Time: an untrained Isensee U-Net (`--base-filters`, depth 5) on a phantom case of 240x240x155, exported with
  `--onnx`, each runtime in its own process with one thread (OMP_NUM_THREADS=1, which onnxruntime's session
  reads too), the onnxruntime one in a process where importing torch fails, as in its image. The time is that of
  `predict` on the case once the bundle is loaded and one case was predicted (the measured case is the second):
  reading, preprocessing, the network, mapping back, writing. CPU seconds of the process, and wall seconds.

Prints a table and writes the JSON (with the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's brats_swap, whatever is installed
BLOCK_TORCH = '''import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "monai"):
            raise ImportError(f"{name}: blocked (this process predicts without torch)")
        return None
sys.meta_path.insert(0, _NoTorch())
'''


def installed_bytes(names: list[str]) -> int:
    """The bytes of the files the distributions `names` installed (their RECORDs)."""
    total = 0
    for name in names:
        for file in metadata.distribution(name).files or []:
            path = Path(file.locate())
            if path.is_file():
                total += path.stat().st_size
    return total


def environment_sizes() -> dict[str, dict]:
    from brats_swap.ship.container import ONNX_RUNTIME_ROOTS, _closure

    torch_image = sorted(set(_closure(["brats-swap", "torch"])) - {"brats-swap"})
    onnx_image = sorted(_closure(list(ONNX_RUNTIME_ROOTS)))
    return {"torch": {"distributions": len(torch_image), "bytes": installed_bytes(torch_image)},
            "onnxruntime": {"distributions": len(onnx_image), "bytes": installed_bytes(onnx_image)}}


def du_bytes(folder: Path) -> int:
    done = subprocess.run(["du", "-sk", str(folder)], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0]) * 1024


def make_bundles(work: Path, cube: int, patch: int, base_filters: int) -> tuple[Path, dict[str, Path]]:
    """A phantom case of 240x240x155 and the two bundles (whole volume, sliding window) exported with --onnx."""
    import torch

    from brats_swap.config import load_config
    from brats_swap.config.loader import config_to_dict, config_to_yaml
    from brats_swap.data.phantom import synthesize_dataset
    from brats_swap.model import build_model
    from brats_swap.model.targets import run_output_count
    from brats_swap.run.checkpoint import save_checkpoint
    from brats_swap.run.folder import RunFolder
    from brats_swap.ship.bundle import export_bundle

    root = work / "data"
    synthesize_dataset(root, 1, seed=0, shape=(240, 240, 155))
    kinds = {"whole volume": [], "sliding window": ["train.mode=patch", f"train.patch=[{patch},{patch},{patch}]"]}
    bundles = {}
    for kind, extra in kinds.items():
        config = load_config(None, [f"name=bench-{kind.split()[0]}", f"data.root={root}", f"data.cube=[{cube},{cube},{cube}]",
                                    f"model.base_filters={base_filters}", "train.device=cpu", *extra])
        run = RunFolder(work / kind.replace(" ", "-"))
        run.root.mkdir(parents=True)
        run.config.write_text(config_to_yaml(config), encoding="utf-8")
        torch.manual_seed(0)
        model = build_model(config.model, out_channels=run_output_count("2021", config.model))
        save_checkpoint({"model": model.state_dict(), "config": config_to_dict(config), "edition": "2021",
                         "epoch": 1, "optimizer": {"state": {}, "param_groups": []}}, run.fold(0).best)
        bundles[kind] = export_bundle(run.root, work / f"{run.root.name}.zip", onnx=True).path
    return root, bundles


def worker(runtime: str, bundle: str, cases: str, out: str) -> None:
    """One runtime's timing (run in its own process): the second prediction of the case."""
    from brats_swap.evaluate.case_prediction import predict_with
    from brats_swap.ship.bundle import open_bundle
    from brats_swap.ship.onnx_runtime import runtime_predictor

    predictor = runtime_predictor(open_bundle(Path(bundle)), runtime, device="cpu")
    predict_with(predictor, Path(cases), Path(out) / "warm-up", progress=False)
    cpu, wall = time.process_time(), time.perf_counter()
    predict_with(predictor, Path(cases), Path(out) / "timed", progress=False)
    print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
                      "torch_imported": "torch" in sys.modules}))


def timed(runtime: str, bundle: Path, cases: Path, work: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if runtime == "onnxruntime":
        blocker = work / "blocker"
        blocker.mkdir(exist_ok=True)
        (blocker / "sitecustomize.py").write_text(BLOCK_TORCH, encoding="utf-8")
        env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(REPO)])
    out = Path(tempfile.mkdtemp(dir=work))
    done = subprocess.run([sys.executable, __file__, "--worker", runtime, str(bundle), str(cases), str(out)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{runtime} worker failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_onnx.json"))
    parser.add_argument("--cube", type=int, default=128)
    parser.add_argument("--patch", type=int, default=64)
    parser.add_argument("--base-filters", type=int, default=8)
    parser.add_argument("--venv", type=Path, action="append", default=[], help="also `du` this environment")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    load_before = os.getloadavg()
    sizes = environment_sizes()
    venvs = {str(folder): du_bytes(folder) for folder in args.venv}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:
        work = Path(tmp)
        cases, bundles = make_bundles(work, args.cube, args.patch, args.base_filters)
        for kind, bundle in bundles.items():
            for runtime in ("torch", "onnxruntime"):
                rows.append({"model": kind, "runtime": runtime, **timed(runtime, bundle, cases, work)})
    record = {"case": [240, 240, 155], "cube": args.cube, "patch": args.patch, "base_filters": args.base_filters,
              "threads": 1, "sizes": sizes, "venv_du_bytes": venvs, "timings": rows,
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print("| environment | distributions | installed |")
    print("|---|---|---|")
    for name, size in sizes.items():
        print(f"| {name} | {size['distributions']} | {size['bytes'] / 2**20:.0f} MiB |")
    for folder, size in venvs.items():
        print(f"| du {folder} | | {size / 2**20:.0f} MiB |")
    print("\n| model | runtime | CPU s per case | wall s per case |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['runtime']} | {row['cpu_s']:.1f} | {row['wall_s']:.1f} |")
    print(f"\nload average before {load_before[0]:.2f}, after {record['load_average_after'][0]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
