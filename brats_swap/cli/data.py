"""`brats-swap data check|prepare|synth`: inspect a BraTS folder, build the prepared cache, make phantoms."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from brats_swap.cli.common import (
    ConfigOption,
    SetOption,
    console,
    err_console,
    flag,
    handle_errors,
    resolve_config,
)
from brats_swap.errors import ConfigError, DataError

# `data synth` numbers the cases of seed s from s x SEED_ID_STRIDE (unless --id-offset says otherwise).
SEED_ID_STRIDE = 1000

app = typer.Typer(help="Check, prepare and synthesize BraTS data.", no_args_is_help=True)

RootArgument = Annotated[
    Path | None,
    typer.Argument(help="Dataset folder (BraTS download or phantoms; default: the config's data.root).",
                   show_default=False),
]
EditionOption = Annotated[
    str | None,
    typer.Option("--edition", help="Force the BraTS edition: 2017, 2018, 2019, 2020, 2021, 2023 (= gli) "
                                   "(default: data.edition, auto-detected from file names).", show_default=False),
]
ChallengeOption = Annotated[
    str | None,
    typer.Option("--challenge", help="Force the 2023+ challenge: gli, gli-post, met, men, men-rt, ped, ssa, goat "
                                     "(default: data.challenge, auto-detected from case ids).", show_default=False),
]
WorkersOption = Annotated[str | None, typer.Option(
    "--workers", "-j", help="Parallel processes: a number, or auto = every CPU this process may use (default: "
                            "data.prepare_workers, auto).", show_default=False)]
StrictOption = Annotated[bool, flag("--strict/--no-strict", "Any bad case is an error (exit 1) instead of "
                                                             "being listed and skipped.")]


@app.command("check")
@handle_errors
def check(root: RootArgument = None, edition: EditionOption = None, challenge: ChallengeOption = None,
          strict: StrictOption = False, workers: WorkersOption = None, config: ConfigOption = None,
          set_: SetOption = None) -> None:
    """Find and validate every case: label table, shape, spacing, label counts and problems."""
    cfg = resolve_config(config, _forcing(set_, edition, challenge), data_root=root)
    from brats_swap.data.check import check_dataset, convention_doubts, summary_line  # after a config error
    from brats_swap.data.preprocess import preprocess_settings

    folder = root if root is not None else Path(cfg.data.root)
    results = check_dataset(folder, cfg.data.edition, cfg.data.modalities, challenge=cfg.data.challenge,
                            fit_to=preprocess_settings(cfg.data), workers=_workers(workers, cfg.data),
                            console=err_console)

    table = Table(title=f"{folder}: {len(results)} cases")
    for column in ("case", "table", "shape", "spacing (mm)"):
        table.add_column(column, no_wrap=True)
    table.add_column("labels (voxels)")
    table.add_column("problems", overflow="fold")
    for r in results:
        shape = "x".join(map(str, r.shape)) if r.shape else "-"
        spacing = "x".join(f"{s:g}" for s in r.spacing) if r.spacing else "-"
        labels = ", ".join(f"{k} {v}" for k, v in r.label_counts.items()) if r.label_counts else "no seg"
        notes = [f"[red]{r.problem}[/]"] if r.problem else []
        notes += [f"[yellow]{n}[/]" for n in (*r.notes, *([r.cropped] if r.cropped else []))]
        table.add_row(r.case_id, r.edition, shape, spacing, labels if r.ok else "-", "; ".join(notes) or "ok")
    console.print(table)
    console.print(_label_tables(sorted({r.edition for r in results})))
    bad = [r for r in results if not r.ok]
    cropped = [r for r in results if r.cropped]
    console.print(summary_line(results))
    doubts = convention_doubts({r.case_id: r.problem for r in bad}, {r.case_id: r.edition for r in results})
    for line in doubts:
        console.print(f"[yellow]warning:[/] {line}", highlight=False)
    if bad and strict:
        raise DataError(f"{bad[0].problem} ({len(bad)} bad cases, --strict)")
    if cropped and strict:
        raise DataError(f"{cropped[0].cropped} ({len(cropped)} cases lose tumour voxels, --strict)")
    if len(bad) == len(results):
        raise DataError(f"{folder}: no usable case ({bad[0].problem})")


@app.command("prepare")
@handle_errors
def prepare(
    root: RootArgument = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Cache folder (default: the config's data.cache).",
                                             show_default=False)] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    workers: WorkersOption = None,
    edition: EditionOption = None,
    challenge: ChallengeOption = None,
    strict: StrictOption = False,
) -> None:
    """Crop, normalize and fit every case to data.cube into an on-disk cache (incremental, atomic)."""
    cfg = resolve_config(config, _forcing(set_, edition, challenge), data_root=root)
    from brats_swap.data.cache import prepare_dataset  # after a config error: the data stack loads slowly
    from brats_swap.data.check import preparation_warnings

    folder = root if root is not None else Path(cfg.data.root)
    cache = out if out is not None else Path(cfg.data.cache)
    report = prepare_dataset(folder, cache, cfg.data, workers=_workers(workers, cfg.data), strict=strict,
                             console=err_console)
    for case_id, problem in report.failed.items():
        console.print(f"[yellow]skipped {case_id}:[/] {problem}")
    for line in preparation_warnings(report):
        console.print(f"[yellow]warning:[/] {line}")
    console.print(f"{cache}: {len(report.prepared)} prepared, {len(report.up_to_date)} up to date, "
                  f"{len(report.failed)} skipped in {report.seconds:.1f} s "
                  f"(cube {'x'.join(map(str, cfg.data.cube))}, fit {cfg.data.fit}, {cfg.data.cache_dtype})")
    if not report.cases:
        raise DataError(f"{folder}: no usable case to prepare")


@app.command("synth")
@handle_errors
def synth(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output folder (default: the config's data.root).",
                                             show_default=False)] = None,
    cases: Annotated[int | None, typer.Option("--cases", "-n", help="Number of cases (default: data.synth.cases).",
                                              show_default=False)] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Random seed (default: data.synth.seed).",
                                             show_default=False)] = None,
    edition: Annotated[str | None, typer.Option("--edition", help="Naming and labels: 2017 ... 2021, 2023 "
                                                "(default: data.synth.edition).", show_default=False)] = None,
    challenge: Annotated[str | None, typer.Option(
        "--challenge", help="Naming and labels of a 2023+ challenge instead: gli, gli-post, met, men, men-rt, "
                            "ped, ssa, goat (default: data.challenge unless auto).", show_default=False)] = None,
    shape: Annotated[tuple[int, int, int] | None, typer.Option("--shape", help="Volume size X Y Z "
                                                               "(default: data.synth.shape, 240 240 155).",
                                                               show_default=False)] = None,
    id_offset: Annotated[int | None, typer.Option("--id-offset", min=0, help="Number the cases from this "
                                                  "offset (default: 1000 x the seed, so folders of different "
                                                  "seeds never share a case id).", show_default=False)] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Write BraTS-format phantom cases (modalities + seg, NIfTI gz, 1 mm), deterministic per seed.

    Case ids are numbered from --id-offset (default 1000 x the seed: seed 0 gives BraTS2021_00000 ...,
    seed 7 BraTS2021_07000 ...), so predictions for one folder are never scored against another's cases."""
    from brats_swap.data.phantom import synthesize_dataset

    overrides = list(set_ or [])
    for key, value in (("cases", cases), ("seed", seed), ("edition", edition)):
        if value is not None:
            overrides.append(f"data.synth.{key}={value}")
    if shape is not None:
        overrides.append(f"data.synth.shape=[{','.join(map(str, shape))}]")
    if challenge is not None:
        overrides.append(f"data.challenge={challenge}")
    cfg = resolve_config(config, overrides)
    synth_cfg = cfg.data.synth
    if synth_cfg.cases < 1 or len(synth_cfg.shape) != 3 or min(synth_cfg.shape) < 8:
        raise DataError(f"synth: need at least 1 case and a shape of three sizes >= 8, got {synth_cfg.cases} "
                        f"cases of {synth_cfg.shape}")
    folder = out if out is not None else Path(cfg.data.root)
    # A forced challenge (--challenge, or data.challenge of the config) names and labels the phantoms.
    table = cfg.data.challenge if cfg.data.challenge != "auto" else synth_cfg.edition
    offset = id_offset if id_offset is not None else SEED_ID_STRIDE * synth_cfg.seed
    ids = synthesize_dataset(folder, synth_cfg.cases, synth_cfg.seed, table, tuple(synth_cfg.shape), progress=True,
                             id_offset=offset)
    console.print(f"{folder}: wrote {len(ids)} {table} phantom cases "
                  f"({'x'.join(map(str, synth_cfg.shape))}, seed {synth_cfg.seed}): {ids[0]} ... {ids[-1]}")


def _workers(option: str | None, data_cfg) -> int | str:
    """--workers (a number or auto) over data.prepare_workers; a bad value is a one-line error."""
    value = option if option is not None else data_cfg.prepare_workers
    if value == "auto" or (str(value).isdigit() and int(value) >= 1):
        return value if value == "auto" else int(value)
    raise ConfigError(f"--workers: expected a number of at least 1, or auto, got {value!r}")


def _forcing(set_: list[str] | None, edition: str | None, challenge: str | None) -> list[str]:
    """The --set overrides plus those of --edition / --challenge."""
    return [*(set_ or []), *([f"data.edition={edition}"] if edition else []),
            *([f"data.challenge={challenge}"] if challenge else [])]


def _label_tables(keys: list[str]) -> Table:
    """The label table of every convention the cases were checked against."""
    from brats_swap.data.challenges import get_challenge

    table = Table(title="label tables (data.challenge / data.edition force another)")
    for column in ("table", "what", "labels", "evaluation groups", "default regions"):
        table.add_column(column, overflow="fold")
    for key in keys:
        spec = get_challenge(key)
        table.add_row(key, spec.title, spec.describe_labels(), spec.describe_groups(), ", ".join(spec.regions))
    return table
