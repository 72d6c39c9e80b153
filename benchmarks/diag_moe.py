"""Decode launch sweep of qcompile::fused_moe on one GPU: for each expert shape and token count, the
default rule's time next to single-parameter variants of it (GEMM 2 split, GEMM 1 column tile, row
tile, pipeline stages, per-pair / folded layouts, prologue quantization). One line per (shape, T).

    python benchmarks/diag_moe.py [--shapes ...] [--tokens 1 4 16 64] [--kind fp8]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qcompile.bench import graph_time_us
from qcompile.kernels import moe_config as mc
from qcompile.kernels import moe_triton as mt
from qcompile.scheme import fp8_scheme

SHAPES = {"mixtral": (8, 4096, 14336, 2), "qwen3-30b-a3b": (128, 2048, 768, 8),
          "gpt-oss-20b": (32, 2880, 2880, 4), "deepseek-v2-lite": (64, 2048, 1408, 6)}
KINDS = {"fp8": fp8_scheme("channel", "dynamic_token").key, "fp8_block": fp8_scheme("block", "dynamic_group").key,
         "fp8_static": fp8_scheme("tensor", "static_tensor").key}


def t_us(fn) -> str:
    try:
        return f"{graph_time_us(fn, 20, 10):.1f}"
    except Exception as exc:  # noqa: BLE001 - a layout that does not compile or fit
        torch.cuda.synchronize()
        return f"fails ({type(exc).__name__})"


def variants(d: mc.MoeConfig) -> dict[str, mc.MoeConfig]:
    g1, g2 = d.gemm1, d.gemm2
    out = {f"split2={s}": replace(d, gemm2=replace(g2, split_k=s)) for s in (1, 2, 4, 8) if s != g2.split_k}
    out |= {f"bn1={b}": replace(d, gemm1=replace(g1, block_n=b)) for b in (32, 64, 128) if b != g1.block_n}
    out["stages3"] = replace(d, gemm1=replace(g1, num_stages=3), gemm2=replace(g2, num_stages=3))
    out["warps8"] = replace(d, gemm1=replace(g1, num_warps=8), gemm2=replace(g2, num_warps=8))
    out["bm32"] = replace(d, block_m=32) if d.block_m == 16 else replace(d, block_m=16)
    out["prologue-quant"] = replace(d, gemm1=replace(g1, fuse_quant=True), gemm2=replace(g2, fuse_quant=True))
    out["per-pair-fold"] = replace(d, block_m=16, per_pair=True, fold_topk=True)
    out["per-pair"] = replace(d, block_m=16, per_pair=True, fold_topk=False)
    return out


def align_sweep(shapes, tokens) -> None:
    """moe_align alone (16-row blocks) per warp count."""
    from qcompile.kernels.moe_kernels import moe_align

    for name in shapes:
        e, _, _, k = SHAPES[name]
        for t in tokens:
            ids = torch.rand(t, e, device="cuda").argsort(1)[:, :k].to(torch.int32)
            cells = [f"warps {w} {t_us(lambda: moe_align(ids, e, 16, num_warps=w))}" for w in (1, 2, 4, 8, 16)]
            print(f"align {name} T={t}: " + " | ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--kind", default="fp8", choices=list(KINDS))
    args = ap.parse_args()
    scheme = KINDS[args.kind]
    q = mc.moe_quant(scheme)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"GPU {torch.cuda.get_device_name()}, scheme {scheme}", flush=True)
    align_sweep(args.shapes, args.tokens)
    for name in args.shapes:
        e, h, i, k = SHAPES[name]
        base = mt.make_moe_inputs(scheme, e, h, i, k, max(args.tokens), device="cuda")
        for t in args.tokens:
            a = dict(base, x=base["x"][:t].contiguous(), topk_ids=base["topk_ids"][:t].contiguous(),
                     topk_weights=base["topk_weights"][:t].contiguous())
            if a["a13_scale"] is not None:
                a["a2_scale"] = torch.tensor(0.05, device="cuda")
            d = mc.normalize_config(mc.default_config(q, e, h, i, k, t, sms), q, True)
            cells = [f"default {t_us(lambda: mt.fused_moe(**a, config=d))}"]
            for label, cfg in variants(d).items():
                cfg = mc.normalize_config(cfg, q, True)
                cells.append(f"{label} {t_us(lambda: mt.fused_moe(**a, config=cfg))}")
            used = int(a["topk_ids"].unique().numel())
            print(f"{name} T={t} experts {used} [bm={d.block_m} bn1={d.gemm1.block_n} split2={d.gemm2.split_k}]: "
                  + " | ".join(cells), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
