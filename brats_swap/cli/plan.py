"""`brats-swap plan`: predict device memory and step time of every memory policy before anything runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from brats_swap.atomic import atomic_write_json
from brats_swap.cli.common import ConfigOption, SetOption, console, handle_errors, resolve_config
from brats_swap.errors import ConfigError
from brats_swap.memory.planner import GIB, PlanReport
from brats_swap.train.planning import plan_for_config, write_timeline_png

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
    print_report(report)
    if json_out is not None:
        atomic_write_json(json_out, report.as_dict())
        console.print(f"wrote {json_out}")
    if save_profile is not None:
        atomic_write_json(save_profile, report.cost_model)
        console.print(f"wrote {save_profile}")
    if timeline is not None:
        shown = report.chosen or next(p for p in report.policies if p.name == "none")
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


def _short(names: list[str], shown: int = 3) -> str:
    """A list of module globs for one line: the first few, then how many more (--json has them all)."""
    if len(names) <= shown:
        return str(names)
    return str(names[:shown])[:-1] + f", ... {len(names) - shown} more]"


def print_report(report: PlanReport) -> None:
    shape = "x".join(str(v) for v in report.input_shape[2:])
    budget = f"{report.budget_gib:g} GiB" if report.budget_gib is not None else "none"
    budget += f" (device overhead {report.device_overhead_gib:g} GiB)"
    table = Table(title=f"memory plan: {shape}, batch {report.batch}, {report.dtype}, budget {budget}, "
                        f"floor {report.floor_gib:.2f} GiB, link {report.bandwidth_gbs:g} GB/s",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("policy", "peak\nGiB", "swapped\nGiB", "recompute\nGFLOP", "step\ns", "vs\nnone", "fits"):
        table.add_column(column, justify="left" if column == "policy" else "right", no_wrap=True)
    baseline = report.baseline_step_s()
    for policy in report.policies:
        overhead = f"{(policy.step_s / baseline - 1) * 100:+.0f}%" if baseline else "-"
        fits = "-" if report.budget_gib is None else ("yes" if policy.fits else "no")
        table.add_row(policy.name, f"{policy.peak_bytes / GIB:.2f}", f"{policy.swapped_bytes / GIB:.2f}",
                      f"{policy.recompute_flops / 1e9:.1f}", f"{policy.step_s:.3f}", overhead, fits)
    console.print(table)
    console.print(f"time model: {report.cost_model.get('name', '?')}; planned in {report.plan_seconds:.1f} s")
    if report.chosen is not None:
        cfg = report.chosen.policy
        knobs = f"mode={cfg.mode}"
        if cfg.mode in ("swap", "hybrid"):
            knobs += (f" swap.tensors={cfg.swap.tensors} swap.include={_short(cfg.swap.include)}"
                      f" swap.exclude={_short(cfg.swap.exclude)} swap.lookahead={cfg.swap.lookahead}"
                      f" swap.max_inflight_bytes={cfg.swap.max_inflight_bytes} swap.compress={cfg.swap.compress}")
            if cfg.swap.mid_lookahead >= 1:
                knobs += (f" swap.mid_lookahead={cfg.swap.mid_lookahead} swap.mid_from_marker="
                          f"{cfg.swap.mid_from_marker} swap.mid_until_block={cfg.swap.mid_until_block}")
        if cfg.mode in ("recompute", "hybrid"):
            knobs += (f" recompute.norm_act={cfg.recompute.norm_act}"
                      f" recompute.norm_act_exclude={_short(cfg.recompute.norm_act_exclude)}"
                      f" recompute.modules={_short(cfg.recompute.modules)}")
        console.print(f"chosen: {report.chosen.name} ({knobs}): {report.reason}")
    else:
        console.print(f"[bold red]{report.reason}[/]")
