"""Drive qcompile's wo_mma kernel for a profiler (Nsight Compute): a few launches per M on fresh
weight copies (the weights are not served from L2), tiled as a loaded model runs them.

    ncu --clock-control none -k regex:wo_mma --launch-skip 6 --launch-count 1 --set full \\
        python benchmarks/profile_wo_mma.py --m 16
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from qcompile.kernels import quant_math, wo_mma

from bench_wo_linear import FORMATS, random_weights


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--format", default="int4 g128", choices=list(FORMATS))
    p.add_argument("--launches", type=int, default=8)
    p.add_argument("--max-cluster", type=int, default=8, help="1: split-K through global memory")
    p.add_argument("--canonical", action="store_true", help="the checkpoint layout instead of tiled")
    p.add_argument("--kw", default="{}", help='more wo_mma keywords as JSON, e.g. \'{"wgmma": true, "split": 4}\'')
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    spec = FORMATS[args.format]
    x = torch.randn(args.m, args.k, device="cuda", generator=g).bfloat16()
    for i in range(args.launches):
        q = random_weights(spec, args.n, args.k, g)
        w, sp = q["weight"], spec
        if not args.canonical:
            w, sp = quant_math.tile_weight(w, spec), replace(spec, tiled=True)
        wo_mma.wo_mma(x, w, q["weight_scale"], q["weight_global_scale"], None, None, sp, max_cluster=args.max_cluster,
                      **json.loads(args.kw))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
