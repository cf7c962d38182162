"""Each 3-D convolution of a network, forward and backward on the CPU: torch's own kernel against oneDNN's.

For every distinct convolution (input shape, weight, stride) of the networks `scripts/bench_compile.py` runs
(the 1x1x1 ones included, which the compiled step leaves to torch: their oneDNN column is oneDNN's forward),
the kernel torch picks (`aten::slow_conv3d_forward`, its im2col kernel, or `aten::mkldnn_convolution`, read
from the profiler), what a compiled chain runs (`brats_swap.memory.compiled.onednn_path`: oneDNN "forward and
backward", oneDNN's "forward" only, or torch's own choice: "torch"), then the forward and backward times of
`F.conv3d` (torch's choice) and of `onednn_convolution` with its size floor off (`min_voxels=0`, so the
inputs under the floor are timed too: the floor's evidence), medians of `--repeats` after one warm-up. A
table on stdout, the rows as JSON.

    OMP_NUM_THREADS=1 python scripts/bench_conv_kernels.py --cubes 64 96 --json docs/benchmarks/bench_conv_kernels.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile import NETWORKS, network_config, write_record  # noqa: E402  (the compiled-step table's networks)

from brats_swap.memory.compiled import onednn_convolution, onednn_path, takes_onednn  # noqa: E402
from brats_swap.model import build_model  # noqa: E402


def distinct_convolutions(network: str, filters: int, cube: int, batch: int) -> list[tuple[nn.Conv3d, tuple]]:
    """(module, input shape) of each distinct `nn.Conv3d` call in one forward of the network at `cube`³."""
    torch.manual_seed(0)
    model = build_model(network_config(network, filters, cube))
    seen: dict[tuple, tuple[nn.Conv3d, tuple]] = {}

    def remember(module, inputs, _output):
        shape = tuple(inputs[0].shape)
        seen.setdefault((shape, tuple(module.weight.shape), module.stride), (module, shape))

    hooks = [m.register_forward_hook(remember) for m in model.modules() if type(m) is nn.Conv3d]
    with torch.no_grad():
        model(torch.randn(batch, 4, cube, cube, cube))
    for hook in hooks:
        hook.remove()
    return list(seen.values())


def torchs_kernel(conv: nn.Conv3d, x: torch.Tensor) -> str:
    with torch.profiler.profile() as profile, torch.no_grad():
        conv(x)
    names = {event.name for event in profile.events()}
    for kernel in ("aten::mkldnn_convolution", "aten::slow_conv3d_forward"):
        if kernel in names:
            return kernel.removeprefix("aten::")
    return "other"


def forward_backward_ms(call, conv: nn.Conv3d, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    forward, backward = [], []
    for _ in range(repeats + 1):
        inp = x.detach().requires_grad_()
        started = time.perf_counter()
        out = call(conv, inp)
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        forward.append(middle - started)
        backward.append(time.perf_counter() - middle)
        conv.zero_grad(set_to_none=True)
    return statistics.median(forward[1:]) * 1e3, statistics.median(backward[1:]) * 1e3


def onednn_call(conv: nn.Conv3d):
    """How the oneDNN column runs `conv`: `onednn_convolution` with its size floor off; a convolution it never
    takes (a 1x1x1 kernel) as `torch.mkldnn_convolution`, oneDNN's forward with torch's backward."""
    if takes_onednn(conv):
        return lambda c, i: onednn_convolution(c, i, min_voxels=0)
    return lambda c, i: torch.mkldnn_convolution(i, c.weight, c.bias, c.padding, c.stride, c.dilation, c.groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--cubes", nargs="+", type=int, default=[64])
    parser.add_argument("--filters", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    started_load = os.getloadavg()
    rows = []
    print(f"{'network':12} {'cube':>4} {'input':>22} {'weight':>18} {'s':>1} {'torch picks':>19} "
          f"{'compiled runs':>20} {'torch f/b ms':>14} {'oneDNN f/b ms':>14} {'× f+b':>6}")
    for network in args.networks:
        for cube in args.cubes:
            for conv, shape in distinct_convolutions(network, args.filters, cube, args.batch):
                x = torch.randn(shape)
                kernel = torchs_kernel(conv, x)
                eager = forward_backward_ms(lambda c, i: F.conv3d(i, c.weight, c.bias, c.stride, c.padding), conv, x,
                                            args.repeats)
                path = (onednn_path(conv, x) if takes_onednn(conv) else None) or "torch"
                onednn = forward_backward_ms(onednn_call(conv), conv, x, args.repeats)
                row = {"network": network, "cube": cube, "batch": args.batch, "input": list(shape),
                       "weight": list(conv.weight.shape), "stride": conv.stride[0], "torch_kernel": kernel, "compiled_runs": path,
                       "torch_forward_ms": round(eager[0], 2), "torch_backward_ms": round(eager[1], 2),
                       "onednn_forward_ms": round(onednn[0], 2), "onednn_backward_ms": round(onednn[1], 2),
                       "ratio": round(sum(onednn) / sum(eager), 3)}
                rows.append(row)
                print(f"{network:12} {cube:4} {str(tuple(shape)):>22} {str(tuple(conv.weight.shape)):>18} "
                      f"{conv.stride[0]:1} {kernel:>19} {path:>20} {eager[0]:6.1f}/{eager[1]:6.1f} "
                      f"{onednn[0]:6.1f}/{onednn[1]:6.1f} {row['ratio']:6.2f}", flush=True)
    write_record(args, {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "load_average": {"start": started_load, "end": os.getloadavg()}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
