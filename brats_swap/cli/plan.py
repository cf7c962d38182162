"""`brats-swap plan`: predict device memory and step time of every memory policy before anything runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from brats_swap.atomic import atomic_write_json
from brats_swap.cli.common import ConfigOption, SetOption, console, handle_errors, resolve_config
from brats_swap.config import Config, MemoryConfig
from brats_swap.config.loader import diff_configs
from brats_swap.errors import ConfigError

if TYPE_CHECKING:  # the memory package, the planning and run.device import torch: the functions import them
    from brats_swap.memory.planner import PlanReport  # when they run, so `--help` stays quick (docs/cli.md)
    from brats_swap.train.planning import HostMemory

# `--size 160 192 160`: click gives an option one value; the two edges after it arrive as extra arguments.
CONTEXT = {"allow_extra_args": True}


@handle_errors
def plan(
    ctx: typer.Context,
    config: ConfigOption = None,
    set_: SetOption = None,
    size: Annotated[str | None, typer.Option("--size", help="One edge (a cube) or three (D H W); default: "
                                             "the patch in train.mode=patch, else data.cube.")] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="Batch size (default: train.batch_size).")] = None,
    budget: Annotated[float | None, typer.Option("--budget", help="Device-memory budget in GiB "
                                                "(default: memory.budget_gib).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="fp32, bf16 or fp16 (default: the dtype train.amp "
                                              "trains in).")] = None,
    bandwidth: Annotated[float | None, typer.Option("--bandwidth", help="Host<->device GB/s per direction "
                                                    "(default: memory.bandwidth_gbs, else measured on CUDA, else "
                                                    "50: a PCIe 5 x16 link).")] = None,
    device: Annotated[str, typer.Option("--device", help="Time model: auto (measure CUDA if present, else "
                                        "assume an H200-class GPU), cuda, gpu, cpu.")] = "auto",
    profile: Annotated[Path | None, typer.Option("--profile", help="Saved cost profile JSON "
                                                 "(see --save-profile).")] = None,
    save_profile: Annotated[Path | None, typer.Option("--save-profile", help="Write the cost model used "
                                                      "here as JSON.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")] = None,
    timeline: Annotated[Path | None, typer.Option("--timeline", help="Write the chosen plan's predicted "
                                                  "timeline as PNG.")] = None,
) -> None:
    """Price none, the swap presets, recompute, norm_act, hybrid and the auto-tuned plan for a budget."""
    edges = size_option(size, ctx.args)
    # The planned step's input is the cube: the network's stages adapt to it as they do in training.
    sized = [f"data.cube=[{','.join(map(str, edges))}]", "train.mode=full"] if edges else []
    resolved = resolve_config(config, [*(set_ or []), *sized])
    from brats_swap.memory.budget import GIB  # torch only once the config is sound
    from brats_swap.train.planning import host_memory, plan_for_config, write_timeline_png

    saved_profile = None
    if profile is not None:
        try:
            saved_profile = json.loads(profile.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{profile}: cannot read the cost profile ({exc})") from exc
    # Tracing and pricing take seconds to a minute at full size, with no countable steps: a spinner says so.
    with console.status("planning: tracing one step on the meta device and pricing every policy ..."):
        report, planner = plan_for_config(resolved, batch=batch, budget_gib=budget, dtype=dtype,
                                          bandwidth_gbs=bandwidth, device=device, profile=saved_profile)
    _say(priced_recipe(resolved, config, set_, batch=batch, dtype=dtype))
    print_report(report)
    shown = report.chosen or next(p for p in report.policies if p.name == "none")
    _print_host_memory(host_memory(resolved, planner.arena_bytes(shown.policy)))
    if json_out is not None:
        atomic_write_json(json_out, report.as_dict())
        console.print(f"wrote {json_out}")
    if save_profile is not None:
        atomic_write_json(save_profile, report.cost_model)
        console.print(f"wrote {save_profile}")
    if timeline is not None:
        write_timeline_png(planner, shown.policy, timeline,
                           title=f"{shown.name}: predicted {shown.step_s * 1e3:.1f} ms/step, "
                                 f"peak {shown.peak_bytes / GIB:.2f} GiB")
        console.print(f"wrote {timeline}")


def size_option(size: str | None, extra: list[str]) -> list[int] | None:
    """`--size E` or `--size D H W` as three edges (None: not given); anything else is a one-line error."""
    if size is None and not extra:
        return None
    edges = ([size] if size is not None else []) + list(extra)
    if size is None or len(edges) not in (1, 3) or not all(edge.isdigit() and int(edge) > 0 for edge in edges):
        raise ConfigError(f"plan --size: expected one edge or three (D H W) positive integers, got {edges}")
    return [int(edge) for edge in edges] * (3 if len(edges) == 1 else 1)


def _say(text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def priced_recipe(config: Config, config_file: Path | None, overrides: list[str] | None, *,
                  batch: int | None, dtype: str | None) -> str:
    """One line: which config's batch, dtype and optimizer the plan priced (a `--set model.name=X` alone
    keeps the recipe of the config it is laid over, not that of configs/X.yaml)."""
    from brats_swap.run.device import amp_dtype

    source = str(config_file) if config_file is not None else "the built-in defaults (no --config)"
    batch_text = f"batch {batch} (--batch)" if batch is not None else f"batch {config.train.batch_size} (train.batch_size)"
    dtype_text = f"{dtype} (--dtype)" if dtype is not None else f"{str(amp_dtype(config.train.amp)).split('.')[-1]} " \
                                                                f"(train.amp: {config.train.amp})"
    line = (f"priced: {config.model.name} with the recipe of {source}: {batch_text}, {dtype_text}, optimizer "
            f"{config.train.optimizer} (train.optimizer)")
    named = [item.split("=", 1)[1] for item in overrides or [] if item.replace(" ", "").startswith("model.name=")]
    own = Path("configs") / f"{named[-1]}.yaml" if named else None
    if own is not None and own.is_file() and (config_file is None or Path(config_file).resolve() != own.resolve()):
        line += f"; {own} has that network's own recipe: plan --config {own}"
    return line


def _print_host_memory(host: HostMemory) -> None:
    from brats_swap.memory.budget import GIB

    _say(host.line())
    if host.exceeds_machine:
        console.print(f"[bold yellow]warning:[/] the run needs {host.total_bytes / GIB:.2f} GiB of host memory, "
                      f"more than the {host.available_bytes / GIB:.2f} GiB this machine has available: lower "
                      "data.loader_workers or train.batch_size, or swap less", highlight=False)


# The knobs that say which device and link a plan assumed, not which policy it is.
_NOT_POLICY = {"memory.budget_gib", "memory.bandwidth_gbs", "memory.device_overhead_gib"}


def policy_lines(policy: MemoryConfig) -> list[str]:
    """The `memory.*` keys of `policy` that differ from the defaults, whole, as config lines."""
    from brats_swap.memory.records import RECOMPUTE_MODES, SWAP_MODES

    unread = {"swap": policy.mode not in SWAP_MODES, "recompute": policy.mode not in RECOMPUTE_MODES}
    lines = []
    for key in diff_configs(MemoryConfig(), policy, "memory."):
        parts = key.split(".")[1:]
        if key in _NOT_POLICY or unread.get(parts[0], False):
            continue
        value = policy
        for part in parts:
            value = getattr(value, part)
        lines.append(f"{key}: {value if isinstance(value, str) else json.dumps(value)}")
    return lines or ["memory.mode: none"]


def selecting_lines(report: PlanReport) -> list[str]:
    """The config lines that make training run the chosen plan: `memory.mode: auto` with the budget (the
    fold plans the same at its start on the same device and link), else the chosen policy itself."""
    if report.chosen is None:
        return []
    if report.budget_gib is not None:
        return ["memory.mode: auto", f"memory.budget_gib: {report.budget_gib:g}"]
    return policy_lines(report.chosen.policy)


def priced_step_line(report: PlanReport) -> str:
    """Which step the prices are for and why: compiled where the run compiles (`train.compile`: true, or auto on
    the GPU planned for), else eager."""
    why = f"{report.step_reason}; " if report.step_reason else ""
    if report.eager_reason is not None:
        return f"step: eager ({why}the compiled step is not priced: {report.eager_reason})"
    if report.step == "compiled":
        return (f"step: compiled ({why}each block's saved tensors and allocations are those of its inductor-compiled "
                "graphs: docs/planner.md#compiled-steps)")
    return f"step: eager ({report.step_reason or 'the run does not compile'})"


def print_report(report: PlanReport) -> None:
    from brats_swap.memory.budget import GIB, INFLIGHT_SHARE

    shape = "x".join(str(v) for v in report.input_shape[2:])
    budget = f"{report.budget_gib:g} GiB" if report.budget_gib is not None else "none"
    budget += f" (device overhead {report.device_overhead_gib:g} GiB)"
    table = Table(title=f"memory plan: {shape}, batch {report.batch}, {report.dtype}, {report.step} step, budget {budget}, "
                        f"floor {report.floor_gib:.2f} GiB, link {report.bandwidth_gbs:g} GB/s",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    # Short headers: the table fits 80 columns (a SLURM log, a pipe), where rich would cut the numbers.
    for column in ("policy", "peak\nGiB", "window\nMiB", "swapped\nGiB", "recomp\nGFLOP", "step\ns",
                   "vs\nnone", "fits"):
        table.add_column(column, justify="left" if column == "policy" else "right", no_wrap=True)
    baseline = report.baseline_step_s()
    for policy in report.policies:
        overhead = f"{(policy.step_s / baseline - 1) * 100:+.0f}%" if baseline else "-"
        fits = "-" if report.budget_gib is None else ("yes" if policy.fits else "no")
        inflight = "-" if policy.inflight_bytes is None else f"{policy.inflight_bytes / 2**20:.0f}"
        table.add_row(policy.name, f"{policy.peak_bytes / GIB:.2f}", inflight, f"{policy.swapped_bytes / GIB:.2f}",
                      f"{policy.recompute_flops / 1e9:.1f}", f"{policy.step_s:.3f}", overhead, fits)
    console.print(table)
    _say("window: memory.swap.max_inflight_bytes, the in-flight window: how many bytes may be saved after a "
         f"swapped tensor before the step waits for its copy (unset: 1/{round(1 / INFLIGHT_SHARE)} of what the "
         "budget, or the card, leaves for tensors)")
    _say("floor: the least any keep/swap/recompute policy could need (parameters, optimizer state and the "
         "step's largest working set with every saved tensor off the device until read); no plan goes below it")
    _say(f"time model: {report.cost_model.get('name', '?')}; planned in {report.plan_seconds:.1f} s")
    _say(priced_step_line(report))
    if report.chosen is None:
        console.print(f"[bold red]{report.reason}[/]")
        return
    _say(f"chosen: {report.chosen.name} (mode {report.chosen.policy.mode}): {report.reason}")
    if report.budget_gib is not None:
        _say("the chosen policy, whole (to fix it instead of planning at the fold's start):")
        for line in policy_lines(report.chosen.policy):
            _say(f"  {line}")
    _say("to train with it, put in the config (or --set each):")
    for line in selecting_lines(report):
        _say(f"  {line}")
