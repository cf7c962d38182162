"""The engine's guarantee under compile on the networks too slow to compile in CI: after `--steps` SGD steps from
one seed, swap_all and norm_act give bitwise (`torch.equal`) the losses and weights of `none`, all three with
the network's regions compiled (`CompiledRegions`: chains, oneDNN convolutions). A table on stdout, the rows as
JSON; exit 1 if any network differs.

    OMP_NUM_THREADS=1 python scripts/check_compiled_networks.py --json /tmp/compiled_networks.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from brats_swap.atomic import atomic_write_json
from brats_swap.config import load_config
from brats_swap.memory import CompiledRegions, MemoryEngine
from brats_swap.memory.engine import memory_config_from
from brats_swap.model import build_model, emits_logits

# Each network at the smallest size it builds at (SwinUNETR: an edge of 64, 12 features, one block per stage).
NETWORKS = {
    "segresnet": (["model.features=[4,8,16]"], (16, 16, 16)),
    "resenc_l": (["model.features=[4,8,16]"], (16, 16, 16)),
    "mednext_s": ([], (32, 32, 32)),
    "swinunetr": (["model.features=[12]", "model.blocks=[1,1,1,1]"], (64, 32, 32)),
}
POLICIES = {"swap_all": {"mode": "swap", "swap": {"min_bytes": 0}},
            "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}}}


def train(network: str, policy: dict | None, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Losses and final weights of `steps` SGD steps under `policy` (None: no engine), regions compiled."""
    keys, shape = NETWORKS[network]
    cfg = load_config(None, [f"model.name={network}", f"data.cube=[{shape[0]},{shape[1]},{shape[2]}]", *keys])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    logits = emits_logits(model)
    regions = CompiledRegions(model)
    engine = MemoryEngine(model, memory_config_from(policy)) if policy is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    try:
        for step in range(steps):
            generator = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(1, 4, *shape, generator=generator)
            y = (torch.rand(1, 3, *shape, generator=generator) > 0.7).float()
            torch.manual_seed(step)  # the same dropout masks under every policy
            with engine.step() if engine is not None else torch.enable_grad():
                out = model(x)
                out = out[0] if isinstance(out, list | tuple) else out
                probs = torch.sigmoid(out) if logits else out
                loss = 1 - (2 * (probs * y).sum() + 1e-5) / (probs.sum() + y.sum() + 1e-5)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
        stats = engine.last_stats() if engine is not None else None
        info = {"chains": len(regions.chains), "regions": len(regions.regions), "onednn": len(regions.onednn),
                "swapped_bytes": stats.swapped_out_bytes if stats else 0,
                "recomputed_bytes": stats.recomputed_bytes if stats else 0,
                "norm_act_kept": len(stats.norm_act_skipped) if stats else 0}
    finally:
        if engine is not None:
            engine.close()
        regions.remove()
    return losses, [p.detach().clone() for p in model.parameters()], info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows, failed = [], False
    print(f"{'network':10} {'policy':9} {'bitwise':>7} {'chains':>6} {'regions':>7} {'oneDNN':>6} {'swapped B':>11} "
          f"{'recomputed B':>12} {'kept':>4} {'s':>5}")
    for network in args.networks:
        reference_losses, reference_weights, _info = train(network, None, args.steps)
        for name, policy in POLICIES.items():
            started = time.perf_counter()
            losses, weights, info = train(network, policy, args.steps)
            same = all(map(torch.equal, losses, reference_losses)) and all(map(torch.equal, weights, reference_weights))
            failed |= not same
            rows.append({"network": network, "policy": name, "bitwise": same, **info,
                         "seconds": round(time.perf_counter() - started, 1)})
            print(f"{network:10} {name:9} {str(same):>7} {info['chains']:6} {info['regions']:7} {info['onednn']:6} "
                  f"{info['swapped_bytes']:11} {info['recomputed_bytes']:12} {info['norm_act_kept']:4} "
                  f"{rows[-1]['seconds']:5.0f}", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, {"torch": torch.__version__, "steps": args.steps, "rows": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
