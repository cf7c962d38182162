"""The planner's numbers for every network, on the cards people have (docs/networks.md).

    .venv/bin/python scripts/bench_networks.py                 # every row (CPU only: meta-device traces; an hour)
    .venv/bin/python scripts/bench_networks.py --acceptance    # the issue's three acceptance plans only
    .venv/bin/python scripts/bench_networks.py --acceptance mednext [--rows 0 2]   # MedNeXt's (networks_mednext.*)
    .venv/bin/python scripts/bench_networks.py --networks resenc_l --settings patch --dtypes fp16 --out /tmp/a
    .venv/bin/python scripts/bench_networks.py --merge /tmp/a /tmp/b   # partial runs -> one table

Nothing runs on a GPU: each row is `brats-swap plan`'s prediction (a trace of one training step on the
`meta` device at full size, priced on the assumed H200 time model with a 50 GB/s PCIe 5 link), with a
GPU's default device overhead (`memory.budget`) in every peak, floor and budget. Budgets are cards: 8,
12, 16 and 24 GB. Per network, dtype and input:

- parameters; nnU-Net's published GPU memory for its plan (nvidia-smi during training, fp16 AMP) where
  nnU-Net publishes one, next to the planner's no-policy peak at the same plan for the network as nnU-Net
  builds it (`model.inplace_act=view`) and as brats-swap builds it (the activation in place on the norm's
  base: the same values, three full-size gradient buffers fewer in backward);
- the floor (the least any policy can need), and for each card the step time `auto` predicts relative to
  the no-policy step (null: no plan fits that card).

Inputs: `patch` is nnU-Net's plan (its patch and batch: 128x160x112 batch 2 for nnunet and ResEnc M,
160x192x160 batch 3 for L and 5 for XL; the other networks at nnU-Net's default patch, batch 2, SwinUNETR
at 128x160x128 because its edges must divide by 32); `whole` is a whole 192³ volume, batch 2. The
nnU-Net networks train with nnU-Net's recipe (SGD, Dice + BCE on the regions), the others with the
project's defaults (Adam, weighted Dice). `--acceptance` prices the issue's plans: ResEnc L at its plan on
a 12 GB card (<= 1.25x), XL on 16 GB (<= 1.5x), L on whole 192³ batch 2 on 10 GB (<= 1.3x), fp16.

Writes docs/benchmarks/networks.json (rows as they finish: an interrupted run keeps what it priced) and,
without `--acceptance`, the Markdown table `docs/benchmarks/networks.md` that docs/networks.md links.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.config import Config, load_config
from brats_swap.config.networks import NETWORK_NAMES, NNUNET_PRESETS
from brats_swap.memory.budget import DEFAULT_DEVICE_OVERHEAD_GIB
from brats_swap.memory.cost import ASSUMED_GPU_LINK, default_cost_model
from brats_swap.memory.planner import Planner
from brats_swap.memory.simulate import GIB
from brats_swap.train import planning

REPO = Path(__file__).resolve().parents[1]
CARDS_GB = (8, 12, 16, 24)
DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
DEFAULT_PATCH = ((128, 160, 112), 2)  # nnU-Net's plan for the default network and ResEnc M
SWIN_PATCH = ((128, 160, 128), 2)
WHOLE = ((192, 192, 192), 2)
ACCEPTANCE = [  # (network, setting, dtype, card GB, largest step ratio)
    ("resenc_l", "patch", "fp16", 12, 1.25),
    ("resenc_xl", "patch", "fp16", 16, 1.5),
    ("resenc_l", "whole", "fp16", 10, 1.3),
]
# MedNeXt and Primus (`--acceptance mednext`), on a PCIe 4 link: (network, overrides, edges, batch, dtype,
# card GB, largest step ratio or None where the ratio is only reported). MedNeXt trains with its authors'
# recipe (configs/mednext_l.yaml: AdamW, Dice + CE on the labels).
MEDNEXT_LINK_GBS = 25.0
MEDNEXT_RECIPE = ("train.optimizer=adamw", "train.loss=dice_ce")
MEDNEXT_ACCEPTANCE = [
    ("mednext_l", ("model.kernel_size=5", *MEDNEXT_RECIPE), (128, 128, 128), 2, "fp16", 16, 1.25),
    ("mednext_l", ("model.kernel_size=5", *MEDNEXT_RECIPE), (192, 192, 192), 1, "fp16", 24, 1.5),
    ("mednext_m", ("model.kernel_size=3", *MEDNEXT_RECIPE), (192, 192, 192), 2, "fp16", 24, 1.5),
]


def network_input(network: str, setting: str) -> tuple[tuple[int, int, int], int]:
    """(edges, batch) of `setting` for `network` (module docstring)."""
    if setting == "whole":
        return WHOLE
    if network in NNUNET_PRESETS:
        return NNUNET_PRESETS[network].patch, NNUNET_PRESETS[network].batch_size
    return SWIN_PATCH if network == "swinunetr" else DEFAULT_PATCH


def network_config(network: str, edges: tuple[int, int, int], batch: int, *extra: str) -> Config:
    recipe = ["train.optimizer=sgd", "train.loss=dice_bce", "model.outputs=regions"] if network in NNUNET_PRESETS else []
    return load_config(None, [f"model.name={network}", "data.cube=[{},{},{}]".format(*edges),
                              f"train.batch_size={batch}", *recipe, *extra])


def network_planner(config: Config, dtype: str, link_gbs: float | None = None) -> tuple[torch.nn.Module, Planner]:
    """The network of `config` and a planner of its training step in `dtype` on the assumed GPU (its link:
    `link_gbs` GB/s each way, by default the assumed one)."""
    model = planning.config_model(config)
    torch_dtype = DTYPES[dtype]
    cost = default_cost_model("gpu", torch_dtype)
    if link_gbs is not None:
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = link_gbs * 1e9
        cost.name = cost.name.replace(ASSUMED_GPU_LINK, f"link {link_gbs:g} GB/s")
    return model, Planner(model, planning.training_input_shape(config), dtype=torch_dtype,
                          loss_fn=planning.training_loss(config.train.loss, model), cost=cost,
                          optimizer_state_factor=planning.optimizer_state_factor(config))


def price_acceptance(network: str, overrides: tuple[str, ...], edges: tuple[int, int, int], batch: int, dtype: str,
                     card: float, limit: float | None, link_gbs: float) -> dict:
    """One acceptance plan: `auto` for `network` on a `card` GB card, its step against the no-policy step,
    the host memory of its swap arena, and the planner's breakdown (floor, no-policy peak) when it misses."""
    started = time.perf_counter()
    config = network_config(network, edges, batch, *overrides)
    model, planner = network_planner(config, dtype, link_gbs)
    base = config.memory
    base.device_overhead_gib = DEFAULT_DEVICE_OVERHEAD_GIB
    none = planner.predict("none", base)
    best, _ = planner.auto(card * GIB, base)
    shape = "x".join(map(str, edges))
    row = {"network": network, "overrides": list(overrides), "input": list(edges), "batch": batch, "dtype": dtype,
           "card_gb": card, "link_gbs": link_gbs, "target_ratio": limit,
           "parameters": sum(p.numel() for p in model.parameters()),
           "none_peak_gib": round(none.peak_bytes / GIB, 2), "none_step_s": round(none.step_s, 4),
           "floor_gib": round((planner.floor_bytes() + DEFAULT_DEVICE_OVERHEAD_GIB * GIB) / GIB, 2),
           "device_overhead_gib": DEFAULT_DEVICE_OVERHEAD_GIB, "plan": None}
    if best is not None:
        row["plan"] = {"mode": best.policy.mode, "peak_gib": round(best.peak_bytes / GIB, 2),
                       "step_s": round(best.step_s, 4), "step_ratio": round(best.step_s / none.step_s, 3),
                       "swapped_gib": round(best.swapped_bytes / GIB, 2),
                       "host_arena_gib": round(planner.arena_bytes(best.policy) / GIB, 2),
                       "norm_act": best.policy.recompute.norm_act, "recompute_modules": best.policy.recompute.modules,
                       "prefetch_misses": best.prefetch_misses, "exposed_transfer_s": round(best.exposed_transfer_s, 4)}
    ratio = row["plan"]["step_ratio"] if row["plan"] else None
    row["passes"] = ratio is not None and (limit is None or ratio <= limit)
    if row["plan"] is None:
        row["why"] = (f"no plan fits {card:g} GB: the floor (least any policy needs, {row['floor_gib']:.2f} GiB) "
                      f"is {row['floor_gib'] - card * GIB / GIB:+.2f} GiB over the card")
    elif not row["passes"]:
        row["why"] = (f"the fastest plan that fits is {ratio:.2f}x, {ratio / limit - 1:.0%} over the {limit:g}x "
                      f"goal: {row['plan']['exposed_transfer_s']:.3f} s of copies are not hidden under compute")
    row["label"] = f"{network} {shape} b{batch} {dtype} on {card:g} GB"
    row["command"] = plan_command(row)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def mednext_time_model() -> str:
    return default_cost_model("gpu", torch.float16).name.replace(ASSUMED_GPU_LINK, f"link {MEDNEXT_LINK_GBS:g} GB/s")


def plan_command(row: dict) -> str:
    """The `brats-swap plan` command line that prices an acceptance row."""
    return (f"brats-swap plan --set model.name={row['network']} " + " ".join(f"--set {o}" for o in row["overrides"])
            + f" --size {' '.join(map(str, row['input']))} --batch {row['batch']} --budget {row['card_gb']:g}"
            f" --bandwidth {row['link_gbs']:g} --dtype {row['dtype']} --device gpu")


def acceptance_markdown(rows: list[dict]) -> str:
    lines = ["| plan | goal | fits | peak GiB | step vs no policy | host memory (swap arena) GiB | policy | result |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        plan = row["plan"]
        goal = f"<= {row['target_ratio']:g}x" if row["target_ratio"] else "fits; ratio reported"
        if plan is None:
            lines.append(f"| {row['label']} | {goal} | no (floor {row['floor_gib']:.2f} GiB) | - | - | - | - | "
                         f"{row['why']} |")
            continue
        policy = plan["mode"] + (" + norm_act" if plan["norm_act"] else "")
        if plan["recompute_modules"]:
            policy += f", {len(plan['recompute_modules'])} modules checkpointed"
        if plan["swapped_gib"]:
            policy += f", {plan['swapped_gib']:.2f} GiB swapped"
        result = "meets the goal" if row["passes"] else row["why"]
        lines.append(f"| {row['label']} | {goal} | yes | {plan['peak_gib']:.2f} | {plan['step_ratio']:.2f}x | "
                     f"{plan['host_arena_gib']:.2f} | {policy} | {result} |")
    commands = [f"- `{row['command']}`" for row in rows]
    return "\n".join(lines) + "\n\nEach row is the planner's prediction for:\n\n" + "\n".join(commands) + "\n"


def price(network: str, setting: str, dtype: str, cards: tuple[float, ...]) -> dict:
    """One row: the network at `setting` in `dtype`, `auto` on each card."""
    started = time.perf_counter()
    edges, batch = network_input(network, setting)
    config = network_config(network, edges, batch)
    model, planner = network_planner(config, dtype)
    base = config.memory
    base.device_overhead_gib = DEFAULT_DEVICE_OVERHEAD_GIB
    none = planner.predict("none", base)
    published = (NNUNET_PRESETS[network].published_vram_gb
                 if network in NNUNET_PRESETS and setting == "patch" and dtype == "fp16" else None)
    nnunet_build_peak = None
    if published is not None:  # nnU-Net's figure is for its own build: the activation in place on the norm's view
        _, nnunet_planner = network_planner(network_config(network, edges, batch, "model.inplace_act=view"), dtype)
        nnunet_build_peak = round(nnunet_planner.predict("none", base).peak_bytes / GIB, 2)
    row = {"network": network, "setting": setting, "input": list(edges), "batch": batch, "dtype": dtype,
           "parameters": sum(p.numel() for p in model.parameters()),
           "published_vram_gb": published, "nnunet_build_none_peak_gib": nnunet_build_peak,
           "none_peak_gib": round(none.peak_bytes / GIB, 2),
           "floor_gib": round((planner.floor_bytes() + DEFAULT_DEVICE_OVERHEAD_GIB * GIB) / GIB, 2),
           "device_overhead_gib": DEFAULT_DEVICE_OVERHEAD_GIB, "none_step_s": round(none.step_s, 4), "auto": {}}
    for card in cards:
        best, _ = planner.auto(card * GIB, base)
        row["auto"][f"{card:g}"] = None if best is None else {
            "step_ratio": round(best.step_s / none.step_s, 3), "peak_gib": round(best.peak_bytes / GIB, 2),
            "prefetch_misses": best.prefetch_misses, "mode": best.policy.mode,
            "lookahead": best.policy.swap.lookahead}
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def markdown(rows: list[dict]) -> str:
    head = ("| network | input | dtype | parameters | nnU-Net published GB | planner, nnU-Net's build GiB "
            "| planner no-policy GiB | floor GiB | " + " | ".join(f"auto {c} GB" for c in CARDS_GB) + " |")
    lines = [head, "|" + "---|" * (8 + len(CARDS_GB))]
    for row in rows:
        shape = "x".join(map(str, row["input"])) + f" b{row['batch']}"
        cells = [f"{row['auto'][str(c)]['step_ratio']:.2f}x" if row["auto"].get(str(c)) else "no plan"
                 for c in CARDS_GB]
        published = f"{row['published_vram_gb']:g}" if row["published_vram_gb"] else "-"
        nnunet_build = f"{row['nnunet_build_none_peak_gib']:.1f}" if row.get("nnunet_build_none_peak_gib") else "-"
        lines.append(f"| {row['network']} | {shape} | {row['dtype']} | {row['parameters'] / 1e6:.1f} M | {published} "
                     f"| {nnunet_build} | {row['none_peak_gib']:.1f} | {row['floor_gib']:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def merge_runs(folders: list[Path], out: Path) -> dict:
    if all((folder / "networks_mednext.json").is_file() for folder in folders):
        return merge_acceptance(folders, out)
    runs = [json.loads((folder / "networks.json").read_text(encoding="utf-8")) for folder in folders]
    order = {name: i for i, name in enumerate(NETWORK_NAMES)}
    rows = sorted((row for run in runs for row in run["rows"]),
                  key=lambda row: (order[row["network"]], row["setting"] != "patch", row["dtype"] != "fp16"))
    result = {**runs[0], "rows": rows}
    atomic_write_json(out / "networks.json", result)
    atomic_write_text(out / "networks.md", markdown(rows))
    return result


def merge_acceptance(folders: list[Path], out: Path) -> dict:
    """Partial `--acceptance mednext --rows ...` runs -> one networks_mednext.json / .md, in the table's order."""
    runs = [json.loads((folder / "networks_mednext.json").read_text(encoding="utf-8")) for folder in folders]
    order = [(network, list(edges), batch) for network, _, edges, batch, *_ in MEDNEXT_ACCEPTANCE]
    rows = sorted((row for run in runs for row in run["acceptance"]),
                  key=lambda row: order.index((row["network"], row["input"], row["batch"])))
    for row in rows:
        row["command"] = plan_command(row)
    result = {**runs[0], "time_model": mednext_time_model(), "acceptance": rows}
    atomic_write_json(out / "networks_mednext.json", result)
    atomic_write_text(out / "networks_mednext.md", acceptance_markdown(rows))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--networks", nargs="+", default=list(NETWORK_NAMES), choices=NETWORK_NAMES)
    parser.add_argument("--settings", nargs="+", default=["patch", "whole"], choices=["patch", "whole"])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--acceptance", nargs="?", const="resenc", choices=["resenc", "mednext"],
                        help="Price an issue's acceptance plans only: resenc (the default) or mednext "
                        "(docs/benchmarks/networks_mednext.*).")
    parser.add_argument("--rows", type=int, nargs="+", help="--acceptance mednext: only these rows (0-based).")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--merge", type=Path, nargs="+", help="Folders of partial runs (run in parallel): write "
                        "their rows, in network order, as one networks.json / networks.md in --out.")
    args = parser.parse_args(argv)
    if args.merge:
        return merge_runs(args.merge, args.out)
    torch.set_num_threads(1)
    result: dict = {"time_model": default_cost_model("gpu", torch.float16).name, "cards_gb": list(CARDS_GB),
                    "measured_on_gpu": False, "rows": [], "acceptance": []}
    name = "networks_acceptance.json" if args.acceptance else "networks.json"
    if args.acceptance == "mednext":
        result["time_model"] = mednext_time_model()
        chosen = [MEDNEXT_ACCEPTANCE[i] for i in args.rows] if args.rows else MEDNEXT_ACCEPTANCE
        for network, overrides, edges, batch, dtype, card, limit in chosen:
            row = price_acceptance(network, overrides, edges, batch, dtype, card, limit, MEDNEXT_LINK_GBS)
            result["acceptance"].append(row)
            atomic_write_json(args.out / "networks_mednext.json", result)
            print(row, flush=True)
        atomic_write_text(args.out / "networks_mednext.md", acceptance_markdown(result["acceptance"]))
        return result
    if args.acceptance:
        for network, setting, dtype, card, limit in ACCEPTANCE:
            row = price(network, setting, dtype, (card,))
            found = row["auto"][f"{card:g}"]
            row["target_ratio"], row["passes"] = limit, found is not None and found["step_ratio"] <= limit
            result["acceptance"].append(row)
            atomic_write_json(args.out / name, result)
            print(row, flush=True)
        return result
    for network in args.networks:
        for setting in args.settings:
            for dtype in args.dtypes:
                row = price(network, setting, dtype, CARDS_GB)
                result["rows"].append(row)
                atomic_write_json(args.out / name, result)
                print(row, flush=True)
    atomic_write_text(args.out / "networks.md", markdown(result["rows"]))
    return result


if __name__ == "__main__":
    main()
