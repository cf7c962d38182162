"""The BraTS challenge image of a bundle (`brats-swap container`): a build folder to read, edit and build.

```
DIR/Dockerfile          CUDA 12.8 base (its torch build runs on the A10G, sm_86, and newer cards), a venv of
                        this environment's Python version with its exact package versions, brats-swap from
                        source, the bundle copied in
DIR/.dockerignore       only the files below go into the build context
DIR/requirements.txt    name==version of every package brats-swap needs (torch comes from the CUDA index)
DIR/entrypoint.sh       exec brats-swap serve-challenge --model /opt/brats-swap/model.zip --task ... "$@"
DIR/model.zip           the bundle
DIR/src/                brats-swap's source (pyproject.toml, README.md, brats_swap/)
DIR/brainlesion.yml     the entry of the BrainLesion `brats` package for this image
DIR/README.md           build, local run (--network none, any uid, read-only root), check, save and push
```

`--runtime onnxruntime` writes a smaller image that serves the bundle's ONNX networks (`export --onnx`):
a CUDA 12.8 + cuDNN 9 runtime base (what onnxruntime-gpu's CUDA provider loads), onnxruntime-gpu at this
environment's onnxruntime version, and only what the torch-free predict path imports (numpy, scipy, nibabel,
PyYAML, typer, rich, packaging and their requirements): no torch, MONAI or CUDA wheels of torch's.

The BrainLesion `brats` orchestrator runs an image with `--data_path=/mlcube_io0 --output_path=/mlcube_io2`
and, for an entry with `additional_files`, `--weights=/mlcube_io1/<param_path>`: the entrypoint passes them
on, and serve-challenge reads the bundle from `--weights` when given (weights downloaded by the orchestrator),
else the one baked into the image.

Everything is fetched at build time; at run time the image reads only /input and writes only /output and
/tmp. The organisers' exact `docker run` line is not published; the README's is the one of the 2025
template plus `--user`/`--read-only`, the stricter case.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from dataclasses import dataclass
from importlib import metadata as distributions
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

import brats_swap
from brats_swap.atomic import atomic_write_text
from brats_swap.data.challenges import MODERN_CHALLENGES, get_challenge
from brats_swap.errors import ConfigError, DataError
from brats_swap.names import script_text, shell_word
from brats_swap.ship.bundle import METADATA, Bundle
from brats_swap.ship.time_budget import parse_duration

BASE_IMAGE = "nvidia/cuda:12.8.1-base-ubuntu24.04"
TORCH_INDEX = "https://download.pytorch.org/whl/cu128"
# The NVIDIA driver the base image needs on the host: CUDA 12.8 (Linux driver 570 or newer).
REQUIRED_DRIVER = "570"
# What `container` can check of the torch wheel without network (nothing is fetched while writing): the cu128
# index holds releases only, from 2.7.0 (the first torch built for CUDA 12.8) on; these releases are known to
# be there. A later version is not checked (the table cannot know it): the image build's pip step is the check.
TORCH_CU128_FIRST = "2.7.0"
TORCH_CU128_KNOWN = ("2.7.0", "2.7.1", "2.8.0", "2.9.0", "2.9.1")
# The image's Python is the one requirements.txt was resolved with (this interpreter's major.minor), not the
# base's own (Ubuntu 24.04: 3.12): a pin may have wheels for one and not the other, and the image has no
# compiler. uv installs that Python (a standalone build) at build time.
IMAGE_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
UV_IMAGE = "ghcr.io/astral-sh/uv:0.5.4"
IMAGE_ROOT = "/opt/brats-swap"
IMAGE_BUNDLE = f"{IMAGE_ROOT}/model.zip"
# Installed by the CUDA torch wheel itself (its own CUDA libraries), never pinned from this environment.
_FROM_TORCH = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
# nnU-Net's network library is installed without its dependencies (they would pull another torch), as the
# Makefile does; these are it and its one light import.
NO_DEPS = ("dynamic-network-architectures", "einops")
BUILD_FILES = ("Dockerfile", "requirements.txt", "entrypoint.sh", "model.zip", "src")
# The onnxruntime image: cuDNN 9 and the CUDA 12 runtime libraries are what onnxruntime-gpu's CUDA provider
# loads (torch's image gets them from torch's own wheels).
ONNX_BASE_IMAGE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
# The distributions the torch-free predict path imports (a process where importing torch fails ran it,
# tests/test_onnx.py); their requirements are pinned with them. onnxruntime is installed as its GPU build.
ONNX_RUNTIME_ROOTS = ("numpy", "scipy", "nibabel", "pyyaml", "typer", "rich", "packaging", "onnxruntime")
ONNX_GPU_BUILD = "onnxruntime-gpu"
# The `brats` package's name for the argument its orchestrator passes the weights mount in, and the file the
# entry asks it for (`additional_files.param_path`).
WEIGHTS_PARAMETER = "weights"
WEIGHTS_FILE = "model.zip"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_requirements(root: str = "brats-swap") -> list[str]:
    """`name==version` of every installed distribution `root` needs (its dependencies, recursively, with
    markers evaluated for this interpreter), torch and its CUDA packages left out, sorted."""
    return sorted(f"{name}=={version}" for name, version in _closure([root]).items()
                  if name != _normal(root) and not _FROM_TORCH.match(name))


def onnx_runtime_requirements() -> list[str]:
    """`name==version` of what the onnxruntime image installs: `ONNX_RUNTIME_ROOTS` and their requirements at
    this environment's versions, onnxruntime as its GPU build of the same version; ConfigError when onnxruntime
    is not installed here (its version is the one the bundle's networks were checked with)."""
    pins = _closure(list(ONNX_RUNTIME_ROOTS))
    if "onnxruntime" not in pins:
        raise ConfigError("--runtime onnxruntime: onnxruntime is not installed here; pip install 'brats-swap[onnx]'")
    pins[ONNX_GPU_BUILD] = pins.pop("onnxruntime")
    return sorted(f"{name}=={version}" for name, version in pins.items() if not _FROM_TORCH.match(name))


def _closure(roots: list[str]) -> dict[str, str]:
    """name -> version of the installed distributions `roots` are and need, recursively (markers evaluated for
    this interpreter, no extras)."""
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = _normal(todo.pop())
        if name in seen:
            continue
        try:
            dist = distributions.distribution(name)
        except distributions.PackageNotFoundError:
            continue
        seen[name] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _installed(name: str) -> str | None:
    try:
        return distributions.version(name)
    except distributions.PackageNotFoundError:
        return None


def check_torch_wheel(release: str) -> str | None:
    """ConfigError when `TORCH_INDEX` cannot hold torch `release` (a pre-release or local build, or older than
    its first cu128 wheel); a line saying it was not checked when the release is newer than the known table;
    None when the table knows it."""
    version = Version(release)
    if version.is_prerelease or version.is_devrelease or version.local:
        raise ConfigError(f"torch {release}: a pre-release or local build; {TORCH_INDEX} holds releases only. Write "
                          "the image from an environment with a torch release, or edit the Dockerfile's torch line")
    if version < Version(TORCH_CU128_FIRST):
        raise ConfigError(f"torch {release}: {TORCH_INDEX} has no wheel before {TORCH_CU128_FIRST} (CUDA 12.8); "
                          f"upgrade torch to {TORCH_CU128_FIRST} or later before writing the image")
    if release in TORCH_CU128_KNOWN:
        return None
    return (f"torch {release}: newer than the releases known to have a cu128 wheel ({TORCH_CU128_KNOWN[0]}-"
            f"{TORCH_CU128_KNOWN[-1]}); not checked (no network): the image build's pip step fails if "
            f"{TORCH_INDEX} lacks it")


def torch_release() -> str:
    """This torch's public version (`2.13.0` for `2.13.0+cpu`): the one the image installs, CUDA build."""
    return distributions.version("torch").split("+")[0]


def brainlesion_entry(task: str, image: str, weights_record: str | None = None) -> dict:
    """The `brats` package's algorithm entry for this image: its orchestrator mounts the data at /mlcube_io0 and
    the output at /mlcube_io2 and passes them as `--data_path`/`--output_path`, as the current uid
    (`requires_root: false`), on the CPU too (`cpu_compatible`). With `weights_record` (the Zenodo record of the
    bundle) the entry lists it as `additional_files`: the orchestrator downloads it, mounts it at /mlcube_io1 and
    passes `--weights=/mlcube_io1/model.zip`; without it the image serves the bundle baked into it."""
    spec = get_challenge(task)
    schema = spec.id_format.replace("{index", "{id").replace("{number", "{id")
    year = time.gmtime().tm_year
    entry = {"meta": {"challenge": f"BraTS {year} {task.upper()}", "year": year},
             "run_args": {"docker_image": image, "input_name_schema": schema, "parameters_file": False,
                          "requires_root": False, "shm_size": "4gb", "cpu_compatible": True,
                          "subject_modality_separator": spec.separator}}
    if weights_record is not None:
        entry["additional_files"] = {"record_id": weights_record, "param_name": [WEIGHTS_PARAMETER],
                                     "param_path": [WEIGHTS_FILE]}
    return {f"brats-swap-{task}": entry}


# The 2023+ task a bundle trained on a 2017-2021 table serves by default: the one with the same regions (adult
# glioma), whose table `bundle_predictor` maps the legacy labels onto (4 -> 3).
LEGACY_TASK = "gli"


def resolve_task(bundle: Bundle, task: str | None) -> tuple[str, str | None]:
    """(the task, a line saying why when it is not the one asked for or the bundle's): `--task`, else the
    bundle's challenge, else (a 2017-2021 table) `LEGACY_TASK`; ConfigError for a legacy or unknown `--task`."""
    if task is None and bundle.challenge not in MODERN_CHALLENGES:
        return LEGACY_TASK, (f"--task {LEGACY_TASK}: the bundle was trained on the {bundle.challenge} table, "
                             f"served as the 2023+ task with the same regions (label 4 written as 3); "
                             "give --task to choose another")
    chosen = task or bundle.challenge
    if chosen not in MODERN_CHALLENGES:
        raise ConfigError(f"--task {chosen!r}: expected a 2023+ task ({', '.join(MODERN_CHALLENGES)})")
    if bundle.challenge not in MODERN_CHALLENGES:  # a 2017-2021 table served as the task asked for
        labels = get_challenge(chosen).labels
        how = ("label 4 written as 3" if labels == get_challenge(LEGACY_TASK).labels else
               f"{', '.join(f'{v} {n}' for v, n in labels.items())}: check that these are the bundle's regions")
        return chosen, (f"--task {chosen}: the bundle was trained on the {bundle.challenge} table; its labels are "
                        f"written in the {chosen} table ({how})")
    return chosen, None


@dataclass
class ContainerFolder:
    folder: Path
    task: str
    image: str
    entry: dict
    task_note: str | None = None  # why the task is not the bundle's own (a 2017-2021 table)
    wheel_note: str | None = None  # the torch wheel could not be checked (`check_torch_wheel`)


def write_container(bundle: Bundle, out_dir: Path, task: str | None = None, image: str | None = None,
                    time_budget: str = "8h", *, trainable: bool = False, runtime: str = "torch",
                    weights_record: str | None = None) -> ContainerFolder:
    """Write the build folder (see the module docstring) for `bundle` into `out_dir`; `trainable` adds the
    entrypoint's `train` branch (ship/retrain.py); `runtime` "onnxruntime" writes the torch-free image of the
    bundle's ONNX networks; `weights_record` puts the bundle's Zenodo record in the BrainLesion entry.

    Every value the generated files take from the bundle or the command line is checked first (no newline or
    control character; shell words quoted; `time_budget` parsed as serve-challenge will parse it), so nothing
    is written for a value that would break or inject a line."""
    task, task_note = resolve_task(bundle, task)
    onnx = _check_runtime(bundle, runtime, trainable)
    wheel_note = None if onnx else check_torch_wheel(torch_release())
    parse_duration(time_budget)
    if weights_record is not None:
        weights_record = script_text(weights_record, "--weights-record", "container")
    image = script_text(image or f"brats-swap-{task}:latest", "--image", "container")
    name = script_text(bundle.metadata.get("name"), "bundle name", f"{bundle.path}: {METADATA}")
    source = Path(brats_swap.__file__).resolve().parent
    project = source.parent
    if not (project / "pyproject.toml").is_file():
        raise DataError(f"{project}: no pyproject.toml next to the brats_swap package; brats-swap container needs "
                        "brats-swap installed from its source checkout (pip install -e .)")
    out_dir = Path(out_dir)
    script_text(out_dir, "--out", "container")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: not a folder; give a new folder for the image's build files")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir}: not empty; give a new folder for the image's build files")
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, out_dir / "src" / "brats_swap", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for copied in ("pyproject.toml", "README.md"):  # not `name`: that is the bundle's, in the files below
        shutil.copy2(project / copied, out_dir / "src" / copied)
    shutil.copy2(bundle.path, out_dir / "model.zip")
    if onnx:
        requirements = onnx_runtime_requirements()
        dockerfile = _onnx_dockerfile(bundle, name, task)
    else:
        requirements = [line for line in pinned_requirements() if line.split("==")[0] not in NO_DEPS]
        dockerfile = _dockerfile(bundle, name, task, [f"{n}=={_installed(n)}" for n in NO_DEPS if _installed(n)])
    atomic_write_text(out_dir / "requirements.txt", "\n".join(requirements) + "\n")
    atomic_write_text(out_dir / "Dockerfile", dockerfile)
    atomic_write_text(out_dir / ".dockerignore", "# The build context is this folder; only these go in.\n*\n"
                      + "".join(f"!{name}\n" for name in BUILD_FILES) + "**/__pycache__\n")
    entrypoint = out_dir / "entrypoint.sh"
    script = _entrypoint(task, time_budget, runtime)
    atomic_write_text(entrypoint, script.replace("set -e\n", "set -e\n" + _train_branch(), 1) if trainable else script)
    entrypoint.chmod(0o755)
    entry = brainlesion_entry(task, image, weights_record)
    atomic_write_text(out_dir / "brainlesion.yml", yaml.safe_dump(entry, sort_keys=False))
    atomic_write_text(out_dir / "README.md", _readme(bundle, name, task, image, out_dir, trainable, onnx))
    if trainable and bundle.challenge not in MODERN_CHALLENGES:
        task_note = "\n".join(filter(None, [task_note, _legacy_trainable_note(bundle)]))  # a line each
    return ContainerFolder(out_dir, task, image, entry, task_note, wheel_note)


def _check_runtime(bundle: Bundle, runtime: str, trainable: bool) -> bool:
    """Whether the image serves ONNX networks; ConfigError for an unknown runtime, a trainable onnxruntime
    image (training needs torch) or a bundle without an ONNX network per fold."""
    if runtime not in ("torch", "onnxruntime"):
        raise ConfigError(f"--runtime {runtime!r}: expected torch or onnxruntime")
    if runtime == "torch":
        return False
    if trainable:
        raise ConfigError("--runtime onnxruntime --trainable: retraining needs torch; write a torch image to retrain")
    missing = [record.get("fold") for record in bundle.metadata["folds"] if not isinstance(record.get("onnx"), dict)]
    if missing:
        raise ConfigError(f"{bundle.path}: fold {missing[0]} has no ONNX network; export the run with --onnx for "
                          "--runtime onnxruntime")
    return True


def _legacy_trainable_note(bundle: Bundle) -> str:
    """The line for a trainable image of a bundle trained on a 2017-2021 table (e.g. for GoAT)."""
    return (f"--trainable: the bundle was trained on the {bundle.challenge} table; the image's `train` retrains its "
            "recipe on the table of the cases in /data (GoAT's: 1 NETC, 2 SNFH, 3 ET), and the retrained model.zip "
            "is served in that table")


# The Dockerfiles' common steps: a uv-made virtual environment of this Python (readable by any uid), and the
# bundle copied in, verified, served by the entrypoint as any uid on a read-only root.
_PYTHON_ENVIRONMENT = f"""\
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \\
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 UV_PYTHON_INSTALL_DIR=/opt/python
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \\
    && rm -rf /var/lib/apt/lists/*
COPY --from={UV_IMAGE} /uv /usr/local/bin/uv
RUN uv venv --seed --python-preference only-managed --python ${{PYTHON_VERSION}} /opt/venv \\
    && chmod -R a+rX /opt/python /opt/venv
ENV PATH=/opt/venv/bin:$PATH
"""
_BUNDLE_AND_ENTRYPOINT = f"""\
COPY model.zip {IMAGE_BUNDLE}
# A damaged copy of the bundle fails the build here (every member's sha256), not the organisers' run.
RUN python -c "from brats_swap.ship.bundle import open_bundle; open_bundle('{IMAGE_BUNDLE}')"
COPY entrypoint.sh {IMAGE_ROOT}/entrypoint.sh

# Any uid, read-only root file system: serve-challenge points HOME and the cache folders under /tmp when they
# are not writable, and writes nothing but /output and /tmp.
WORKDIR /tmp
ENTRYPOINT ["{IMAGE_ROOT}/entrypoint.sh"]
"""


def _dockerfile(bundle: Bundle, name: str, task: str, no_deps: list[str]) -> str:
    no_deps_line = (f"RUN pip install --no-deps {' '.join(no_deps)}\n" if no_deps else "")
    return f"""\
# BraTS challenge image: brats-swap bundle {name} ({bundle.challenge} table), task {task}.
# Written by `brats-swap container`; edit freely. Everything is fetched while building, nothing at run time.
#
# CUDA 12.8 base (NVIDIA driver {REQUIRED_DRIVER} or newer): the cu128 torch build runs on the A10G (sm_86) the 2026
# segmentation tasks give, and on newer cards (Ada, Hopper, Blackwell). torch brings its own CUDA libraries.
# Both can be changed at build time: --build-arg BASE_IMAGE=... --build-arg TORCH_INDEX=...
ARG BASE_IMAGE={BASE_IMAGE}
FROM ${{BASE_IMAGE}}

ARG TORCH_INDEX={TORCH_INDEX}
# Python {IMAGE_PYTHON}: the version requirements.txt was resolved with (the base's own Python may differ, and
# a pin may have no wheel for it); uv installs a standalone build of it, readable by any uid.
ARG PYTHON_VERSION={IMAGE_PYTHON}
{_PYTHON_ENVIRONMENT}
# The exact versions of the environment this folder was written from (torch {torch_release()}, CUDA build).
RUN pip install --index-url ${{TORCH_INDEX}} torch=={torch_release()}
COPY requirements.txt {IMAGE_ROOT}/requirements.txt
RUN pip install -r {IMAGE_ROOT}/requirements.txt
# nnU-Net's network library without its dependencies (they would replace torch), as brats-swap's Makefile does.
{no_deps_line}COPY src {IMAGE_ROOT}/src
RUN pip install --no-deps {IMAGE_ROOT}/src

{_BUNDLE_AND_ENTRYPOINT}"""


def _onnx_dockerfile(bundle: Bundle, name: str, task: str) -> str:
    return f"""\
# BraTS challenge image: brats-swap bundle {name} ({bundle.challenge} table), task {task}, its ONNX networks
# served by onnxruntime: no torch in the image. Written by `brats-swap container --runtime onnxruntime`; edit
# freely. Everything is fetched while building, nothing at run time.
#
# CUDA 12.8 + cuDNN 9 runtime base (NVIDIA driver {REQUIRED_DRIVER} or newer): the libraries onnxruntime-gpu's CUDA
# provider loads. Without a GPU (or --device cpu) it runs on the CPU provider. --build-arg BASE_IMAGE=... changes it.
ARG BASE_IMAGE={ONNX_BASE_IMAGE}
FROM ${{BASE_IMAGE}}

ARG PYTHON_VERSION={IMAGE_PYTHON}
{_PYTHON_ENVIRONMENT}
# What the torch-free predict path imports, at this environment's versions; onnxruntime as its GPU build.
COPY requirements.txt {IMAGE_ROOT}/requirements.txt
RUN pip install -r {IMAGE_ROOT}/requirements.txt
COPY src {IMAGE_ROOT}/src
RUN pip install --no-deps {IMAGE_ROOT}/src

{_BUNDLE_AND_ENTRYPOINT}"""


def _train_branch() -> str:
    # A trainable image: `docker run ... IMAGE train [--time-budget 72h]` retrains the bundle's recipe on /data
    # into /output (brats_swap/ship/retrain.py). Later options replace the defaults given here.
    return f"""\
# `train`: retrain the bundle's recipe on /data (read only) into /output/model.zip; run it again to continue.
if [ "$1" = "train" ]; then
    shift
    exec brats-swap train-challenge --model {IMAGE_BUNDLE} --data /data --output /output "$@"
fi
"""


def _entrypoint(task: str, time_budget: str, runtime: str = "torch") -> str:
    task_word = shell_word(task, "--task", "container")
    budget_word = shell_word(time_budget, "--time-budget", "container")
    runtime_option = " --runtime onnxruntime" if runtime == "onnxruntime" else ""
    return f"""\
#!/bin/sh
# The image's entrypoint: segment /input/<case>/ into a flat /output/<case>.nii.gz with the bundle.
# No arguments (BraTS 2025+), MLCube's `infer --data_path=DIR --output_path=DIR` (2023-2024), or the BrainLesion
# brats orchestrator's `--data_path=/mlcube_io0 --output_path=/mlcube_io2 [--weights=/mlcube_io1/model.zip]`
# (a --weights bundle replaces the one in the image): passed on.
# Change the budget or drop test-time augmentation (--no-tta) here.
set -e
exec brats-swap serve-challenge --model {IMAGE_BUNDLE} --task {task_word} --time-budget {budget_word}{runtime_option} "$@"
"""


def _readme(bundle: Bundle, name: str, task: str, image: str, out_dir: Path, trainable: bool = False,
            onnx: bool = False) -> str:
    spec = get_challenge(task)
    example = spec.example_id(1)
    image_word, folder_word = shell_word(image, "--image", "container"), shell_word(out_dir, "--out", "container")
    saved = shell_word(f"{image.replace(':', '_').replace('/', '_')}.tar.gz", "--image", "container")
    return f"""\
# BraTS {task.upper()} image of the brats-swap bundle `{name}`

Written by `brats-swap container`. The bundle ({', '.join(f'fold {k}' for k in bundle.folds)}, trained on the
{bundle.challenge} table) is `model.zip`; the image runs `brats-swap serve-challenge` on it (`entrypoint.sh`).
This Dockerfile was written by brats-swap and has not been built by its own tests; build and run it once,
as below, before submitting.

## Build

    docker build -t {image_word} {folder_word}

(podman: `podman build -t {image_word} {folder_word}`.) The build downloads the CUDA base image,
{"onnxruntime-gpu (the bundle's ONNX networks; no torch)" if onnx else f"torch {torch_release()} (CUDA 12.8 build)"},
Python {IMAGE_PYTHON} (the version `requirements.txt` was resolved with, installed by uv) and the pinned packages.

## Run locally as the organisers do: no network, your uid, read-only input

    mkdir -p out
    docker run --rm --network none --gpus all --user "$(id -u):$(id -g)" --read-only --tmpfs /tmp \\
        --shm-size 4g -v "$PWD/in:/input:ro" -v "$PWD/out:/output:rw" {image_word}

`in/` holds one folder per case, e.g. `in/{example}/{example}{spec.separator}t1c.nii.gz`. Without a GPU,
leave out `--gpus all` (it runs on the CPU, slowly). The older MLCube form works too:

    docker run --rm --network none --gpus all -v "$PWD/in:/data:ro" -v "$PWD/out:/results" {image_word} \\
        infer --data_path=/data --output_path=/results

## Check the output as the organisers will

    brats-swap check-submission out --input in --task {task}
{_retrain_section(image_word) if trainable else ""}
## Save or push

    docker save {image_word} | gzip > {saved}
    docker login docker.synapse.org
    docker tag {image_word} docker.synapse.org/<synapse project id>/{image_word}
    docker push docker.synapse.org/<synapse project id>/{image_word}

## BrainLesion `brats` package

`brainlesion.yml` is this image's entry for the package's algorithm list (add `authors`, `paper` and
`rank` to `meta` as its other entries have them). Its orchestrator runs the image as your uid with
`--data_path=/mlcube_io0 --output_path=/mlcube_io2` (and `--weights=/mlcube_io1/model.zip` when the entry
lists the bundle's Zenodo record under `additional_files`: `brats-swap container --weights-record ID`).
"""


def _retrain_section(image_word: str) -> str:
    """The README's part for a `--trainable` image: how the organisers retrain it (ship/retrain.py)."""
    return f"""
## Retrain it as the organisers will (a `--trainable` image)

    mkdir -p trained
    docker run --rm --network none --gpus all --user "$(id -u):$(id -g)" --read-only --tmpfs /tmp \\
        --shm-size 4g -v "$PWD/data:/data:ro" -v "$PWD/trained:/output:rw" {image_word} train --time-budget 72h

`data/` is a BraTS-format training folder (or an nnU-Net raw / Decathlon one). The entry measures the card,
plans the memory policy within the bundle's recipe, shortens the schedule up front to the time budget (and
says so), trains, and writes `trained/model.zip` with its training log and the plan it chose. Run the same
command again after a stop: it resumes where it stopped.

Serve the retrained model with the same image, its `model.zip` mounted over the one inside:

    docker run --rm --network none --gpus all --user "$(id -u):$(id -g)" --read-only --tmpfs /tmp \\
        --shm-size 4g -v "$PWD/trained/model.zip:{IMAGE_BUNDLE}:ro" -v "$PWD/in:/input:ro" \\
        -v "$PWD/out:/output:rw" {image_word}

(or without a container: `brats-swap serve-challenge --model trained/model.zip --input in --output out`).
"""
