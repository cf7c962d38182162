"""CPU step time eager vs compiled under the memory engine: a table on stdout, the rows as JSON.

For each network and policy, the variants train side by side from the same weights, their steps interleaved
(eager, chains, blocks, whole, eager, ...) so that a busy machine slows each alike:

- `eager`: no compilation;
- `chains`: each block's norm -> activation chain compiled, its convolution eager
  (`brats_swap.memory.CompiledRegions`, what `train.compile` runs);
- `chains_torch`: the same chains, each convolution left to torch's own kernel choice (`convolutions="torch"`):
  what the chains gain without the oneDNN convolutions;
- `blocks`: each block of the engine compiled whole (`CompiledRegions(..., granularity="blocks")`);
- `whole`: `torch.compile(model)`, under `none` only (the engine's hooks cannot run inside one graph).

Columns: the first step (compilation included; what dynamo and inductor spent of it), the median of the later
steps (wall clock, and the process's CPU time) and their ratios to eager, and the engine's peak resident saved
bytes. Policies: `none`, the presets `swap_all` and `recompute` written in the network's module names
(`memory.presets.resolve_presets`, with `min_bytes` 0 so small volumes swap), and `auto` (the planner's choice
under `--budget-gib`).

The first compilation fills a fresh inductor cache (a temporary folder unless `--cache-dir` names one); then,
for each network and compiled variant, a second process compiles the same step from that cache ("cached s":
what a later fold or `predict` pays: dynamo's tracing and the cache's loading).

    python scripts/bench_compile.py --cube 32 --steps 4 --json docs/benchmarks/bench_compile_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from brats_swap.atomic import atomic_write_json
from brats_swap.config import MemoryConfig, ModelConfig, load_config
from brats_swap.config.loader import from_dict
from brats_swap.memory import CompiledRegions, MemoryEngine
from brats_swap.memory.planner import choose_policy
from brats_swap.memory.presets import preset_policy, resolve_presets
from brats_swap.model import build_model, emits_logits
from brats_swap.run.compiling import compile_seconds_so_far


def network_overrides(network: str, filters: int) -> list[str]:
    """The benchmarks' networks as `model.*` overrides: the Isensee U-Net at depth 4, nnU-Net's plain U-Net with
    three stages of `filters`, 2 and 4 times that, deep supervision off."""
    keys = {"isensee2017": [f"model.base_filters={filters}", "model.depth=4"],
            "nnunet": [f"model.features=[{filters},{2 * filters},{4 * filters}]", "model.deep_supervision=false"]}
    return [f"model.name={network}", *keys[network]]


def network_config(network: str, filters: int, cube: int) -> ModelConfig:
    """The network at `cube`³ (`network_overrides`) as the config loader adapts its plan."""
    return load_config(None, [f"data.cube=[{cube},{cube},{cube}]", *network_overrides(network, filters)]).model


NETWORKS = ("isensee2017", "nnunet")
POLICIES = ("none", "swap_all", "recompute", "auto")
VARIANTS = ("eager", "chains", "chains_torch", "blocks", "whole")


def loss_for(model):
    """A soft Dice of the network's first output (sigmoid of logits when the network emits logits)."""
    logits = emits_logits(model)

    def dice_loss(output, target):
        output = output[0] if isinstance(output, list | tuple) else output
        probs = torch.sigmoid(output) if logits else output
        dims = (0, 2, 3, 4)
        return 1 - (2 * (probs * target).sum(dims) + 1e-5).div(probs.sum(dims) + target.sum(dims) + 1e-5).mean()

    return dice_loss


def policy_for(name: str, model, shape, budget_gib: float) -> MemoryConfig | None:
    base = from_dict(MemoryConfig, {"swap": {"min_bytes": 0}}, prefix="memory")
    if name == "none":
        return None
    if name == "auto":
        cfg = from_dict(MemoryConfig, {"mode": "auto", "budget_gib": budget_gib, "swap": {"min_bytes": 0}},
                        prefix="memory")
        chosen, _ = choose_policy(model, cfg, shape, loss_fn=loss_for(model))
        return chosen
    return preset_policy(name, base, resolve_presets(model, shape))


class Variant:
    """One way of running the step, with its own model, engine and optimizer."""

    def __init__(self, kind: str, model_cfg: ModelConfig, policy: MemoryConfig | None):
        torch.manual_seed(0)
        self.kind, self.model = kind, build_model(model_cfg)
        self.run = torch.compile(self.model, dynamic=False) if kind == "whole" else self.model
        self.regions = None
        if kind == "chains_torch":
            self.regions = CompiledRegions(self.model, granularity="chains", convolutions="torch")
        elif kind in ("chains", "blocks"):
            self.regions = CompiledRegions(self.model, granularity=kind)
        self.engine = None if kind == "whole" else MemoryEngine(self.model, policy or "none", measure=policy is None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss = loss_for(self.model)
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.compiling: list[float] = []
        self.compile_s = 0.0

    def step(self, x, y) -> None:
        started, cpu, compiling = time.perf_counter(), time.process_time(), compile_seconds_so_far()
        if self.engine is not None:
            with self.engine.step():
                loss = self.loss(self.run(x), y)
        else:
            loss = self.loss(self.run(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - started)
        self.cpu_times.append(time.process_time() - cpu)
        self.compiling.append(compile_seconds_so_far() - compiling)
        self.compile_s += self.compiling[-1]

    def row(self) -> dict:
        stats = self.engine.last_stats() if self.engine is not None else None
        return {"variant": self.kind, "first_step_s": round(self.times[0], 2), "compile_s": round(self.compile_s, 1),
                "step_s": round(statistics.median(self.times[1:]), 4),
                "step_cpu_s": round(statistics.median(self.cpu_times[1:]), 4),
                "peak_saved_mib": round(stats.peak_resident_saved_bytes / 2**20, 2) if stats is not None else None,
                "recomputed_mib": round(stats.recomputed_bytes / 2**20, 2) if stats is not None else None,
                "norm_act_skipped": len(stats.norm_act_skipped) if stats is not None else None,
                "times_s": [round(t, 4) for t in self.times], "cpu_times_s": [round(t, 4) for t in self.cpu_times],
                "compile_per_step_s": [round(c, 2) for c in self.compiling]}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.regions is not None:
            self.regions.remove()


def bench(network: str, policy_name: str, args) -> list[dict]:
    model_cfg = network_config(network, args.filters, args.cube)
    shape = (args.batch, 4, args.cube, args.cube, args.cube)
    torch.manual_seed(0)
    policy = policy_for(policy_name, build_model(model_cfg), shape, args.budget_gib)
    kinds = [k for k in args.variants if k != "whole" or policy is None]
    variants = [Variant(kind, model_cfg, policy) for kind in kinds]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    y = (torch.rand(args.batch, 3, *shape[2:], generator=generator) > 0.7).float()
    for _ in range(args.steps):
        for variant in variants:
            variant.step(x, y)
    rows = []
    eager = next((v for v in variants if v.kind == "eager"), None)
    for variant in variants:
        row = {"network": network, "policy": policy_name, "mode": policy.mode if policy is not None else "none",
               "cube": args.cube, "filters": args.filters, "batch": args.batch, **variant.row()}
        if eager is not None:
            row["ratio"] = round(row["step_s"] / statistics.median(eager.times[1:]), 3)
            row["cpu_ratio"] = round(row["step_cpu_s"] / statistics.median(eager.cpu_times[1:]), 3)
        rows.append(row)
        variant.close()
    return rows


def compile_once(network: str, kind: str, args) -> float:
    """Seconds dynamo and inductor spend on the first step of `kind` (`none`), in this process."""
    model_cfg = network_config(network, args.filters, args.cube)
    shape = (args.batch, 4, args.cube, args.cube, args.cube)
    variant = Variant(kind, model_cfg, None)
    variant.step(torch.randn(shape), (torch.rand(args.batch, 3, *shape[2:]) > 0.7).float())
    variant.close()
    return variant.compile_s


def cached_compile_seconds(network: str, kind: str, args, cache_dir: Path) -> float:
    """`compile_once` in a new process reading `cache_dir`: what a later fold pays."""
    command = [sys.executable, __file__, "--compile-only", network, kind, "--cube", str(args.cube),
               "--filters", str(args.filters), "--batch", str(args.batch)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--cube", type=int, default=32)
    parser.add_argument("--filters", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1,
                        help="batch size (from 2, torch's own rule already picks oneDNN for every 3-D convolution)")
    parser.add_argument("--steps", type=int, default=4, help="steps per variant (the first compiles)")
    parser.add_argument("--budget-gib", type=float, default=0.01, help="memory.budget_gib for the auto policy")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="inductor's cache (default: a fresh temporary folder, so the first compile is one)")
    parser.add_argument("--no-cached", action="store_true", help="skip the cached compile processes")
    parser.add_argument("--compile-only", nargs=2, metavar=("NETWORK", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.compile_only:
        print(compile_once(*args.compile_only, args))
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step compiles)")
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as scratch:
        cache_dir = args.cache_dir or Path(scratch)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # before anything compiles
        rows, cached = run_table(args, cache_dir)
    write_record(args, {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "load_average": os.getloadavg(), "rows": rows, "cached_compile_s": cached})
    return 0


def write_record(args: argparse.Namespace, record: dict) -> None:
    """`record` with the command's arguments (paths as text) as JSON at `args.json`, if given, whole or not at
    all (the compile and convolution benchmarks write their rows this way)."""
    if args.json is None:
        return
    plain_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, {**record, "args": plain_args})


def run_table(args, cache_dir: Path) -> tuple[list[dict], dict[str, float]]:
    """The table's rows (printed as they come), then the cached compile time per network and compiled variant."""
    rows = []
    print(f"{'network':12} {'policy':10} {'variant':12} {'first s':>8} {'compile s':>9} {'step s':>8} {'ratio':>6} "
          f"{'cpu s':>7} {'ratio':>6} {'peak MiB':>9}")
    for network in args.networks:
        for policy_name in args.policies:
            for row in bench(network, policy_name, args):
                rows.append(row)
                peak = "" if row["peak_saved_mib"] is None else f"{row['peak_saved_mib']:.2f}"
                print(f"{network:12} {policy_name:10} {row['variant']:12} {row['first_step_s']:8.2f} "
                      f"{row['compile_s']:9.1f} {row['step_s']:8.3f} {row.get('ratio', 1.0):6.2f} "
                      f"{row['step_cpu_s']:7.3f} {row.get('cpu_ratio', 1.0):6.2f} {peak:>9}", flush=True)
    cached: dict[str, float] = {}
    if not args.no_cached:
        for network in args.networks:
            for kind in args.variants:
                if kind != "eager":
                    cached[f"{network}/{kind}"] = round(cached_compile_seconds(network, kind, args, cache_dir), 1)
                    print(f"{network:12} {kind:12} cached compile s {cached[f'{network}/{kind}']:.1f}", flush=True)
    return rows, cached


if __name__ == "__main__":
    sys.exit(main())
