"""Decode attention benchmark: one query token's grouped-query attention over a static KV cache.

    python benchmarks/bench_attention.py [--shapes llama-3.1-8b qwen3-30b-a3b llama-3.1-70b-tp8]
        [--cache 256:200 2048:1024 8192:4096] [--batch 1 32] [--json out.json]

For each head layout, cache length (``max_cache_len``) and number of positions written so far (the rest masked
out, as transformers' static-cache mask does), batch: µs per call, median of CUDA-graph replays of calls that
each read another layer's cache (enough copies for 200 MB, four times the L2, so no call finds its keys in L2):

- ``SDPA, repeat_kv``: what transformers' SDPA attention runs under plain ``torch.compile`` (keys and values
  expanded to every query head, then ``F.scaled_dot_product_attention`` with the boolean mask);
- ``SDPA, grouped``: SDPA on the key / value heads with each group's query heads as its rows (what the
  decode-attention pass called before it had a kernel);
- ``qcompile::decode_attention``: the op the decode-attention pass calls now.

With ``--fp8`` the same over an FP8 cache (float8_e4m3fn codes, one fp32 scale per key / value head): ``FP8
read + SDPA, grouped`` dequantizes the layer's keys and values as the cache's read does (``dequantize_kv``),
then SDPA on the key / value heads; ``decode_attention, fp8`` reads the codes and scales itself. Their floor
counts one byte per element.

The floor is the bytes of the written positions' keys and values over the read bandwidth measured in the same
run (``bench_moe.bandwidth_gbps``: the larger of a 2 GiB copy's and a 2 GiB sum's). Each row also checks the op against SDPA (fp32 math) on its first cache.
``--dry-run``: tiny shapes on the CPU, wall clock: a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_moe import bandwidth_gbps  # noqa: E402  (this folder)
from qcompile.bench import device_label, graph_time_us, wall_us  # noqa: E402
from qcompile.kernels import attention as at  # noqa: E402

SHAPES = {  # name: (query heads, key / value heads, head dim)
    "llama-3.1-8b": (32, 8, 128),
    "qwen3-30b-a3b": (32, 4, 128),
    "llama-3.1-70b-tp8": (8, 1, 128),
    "tiny": (4, 2, 16),
}
L2_FLUSH = 200 << 20


def case(shape: str, batch: int, cache: int, used: int, device: str, dtype, dry: bool, sweep=(),
         fp8: bool = False) -> dict:
    heads, kvh, d = SHAPES[shape]
    rep = heads // kvh
    kv_bytes = 2 * batch * kvh * cache * d * torch.finfo(dtype).bits // 8
    copies = 2 if dry else max(2, min(64, -(-L2_FLUSH // kv_bytes)))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, d, generator=g).to(device, dtype)
    ks = [torch.randn(batch, kvh, cache, d, generator=g).to(device, dtype) for _ in range(copies)]
    vs = [torch.randn(batch, kvh, cache, d, generator=g).to(device, dtype) for _ in range(copies)]
    mask = torch.zeros(batch, 1, 1, cache, dtype=torch.bool, device=device)
    mask[..., :used] = True
    grouped = q.reshape(batch, kvh, rep, d)
    it = iter(range(1 << 62))

    def pick():
        i = next(it) % copies
        return ks[i], vs[i]

    def repeated():
        k, v = pick()
        k = k[:, :, None].expand(batch, kvh, rep, cache, d).reshape(batch, heads, cache, d)
        v = v[:, :, None].expand(batch, kvh, rep, cache, d).reshape(batch, heads, cache, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def sdpa_grouped():
        return F.scaled_dot_product_attention(grouped, *pick(), attn_mask=mask)

    def ours():
        return at.decode_attention(grouped, *pick(), mask)

    want = at.reference(grouped.float(), ks[0].float(), vs[0].float(), mask)
    err = (at.decode_attention(grouped, ks[0], vs[0], mask).float() - want).abs().max().item()
    row = dict(shape=shape, batch=batch, cache=cache, used=used, kv_heads=kvh, rep=rep, head_dim=d,
               max_abs_err=err, floor_bytes=2 * batch * kvh * used * d * torch.finfo(dtype).bits // 8)
    fns = [("SDPA, repeat_kv", repeated), ("SDPA, grouped", sdpa_grouped), ("qcompile::decode_attention", ours)]
    if fp8:
        from qcompile.kv_cache import dequantize_kv, quantize_kv

        scales = [(0.5 + torch.rand(1, kvh, 1, 1, generator=g)).to(device) / 100 for _ in range(2)]
        codes = [(quantize_kv(k, scales[0]), quantize_kv(v, scales[1])) for k, v in zip(ks, vs)]
        it8 = iter(range(1 << 62))

        def pick8():
            return codes[next(it8) % copies]

        def fp8_read_sdpa():
            k, v = pick8()
            return F.scaled_dot_product_attention(grouped, dequantize_kv(k, scales[0], dtype),
                                                  dequantize_kv(v, scales[1], dtype), attn_mask=mask)

        def ours8():
            return at.decode_attention(grouped, *pick8(), mask, None, *scales)

        fns += [("FP8 read + SDPA, grouped", fp8_read_sdpa), ("decode_attention, fp8", ours8)]
        want8 = at.reference(grouped, *codes[0], mask, None, *scales).float()
        row["fp8_max_abs_err"] = (at.decode_attention(grouped, *codes[0], mask, None, *scales).float()
                                  - want8).abs().max().item()
    for splits in sweep if at.triton_reason(grouped, ks[0], vs[0], mask) is None else ():
        fns.append((f"splits={splits}", lambda splits=splits: at._triton(grouped, *pick(), mask, d ** -0.5, splits)))
    for name, fn in fns:
        try:
            row[name] = round(wall_us(fn, copies) if dry else graph_time_us(fn, copies, 15), 2)
        except Exception as exc:  # noqa: BLE001 - a peer that does not run is a result, not a crash
            row[name] = f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    return row


COLUMNS = ("SDPA, repeat_kv", "SDPA, grouped", "qcompile::decode_attention")
FP8_COLUMNS = ("FP8 read + SDPA, grouped", "decode_attention, fp8")


def markdown(rows: list[dict], bw: float | None) -> str:
    columns = COLUMNS + (FP8_COLUMNS if rows and FP8_COLUMNS[0] in rows[0] else ())
    head = "| shape (heads / kv heads) | batch | cache: written / length | " + " | ".join(columns)
    lines = [head + (" | floor |" if bw else " |"), "|" + " --- |" * (len(columns) + 3 + bool(bw))]
    for r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in columns]
        floor = r["floor_bytes"] / (bw * 1e9) * 1e6 if bw else None
        if floor:
            cells = [c + (f" ({floor / r[n] * 100 / (2 if n in FP8_COLUMNS else 1):.0f} %)"
                          if isinstance(r[n], float) else "") for c, n in zip(cells, columns)]
        lines.append(f"| {r['shape']} ({r['kv_heads'] * r['rep']} / {r['kv_heads']}) | {r['batch']} | "
                     f"{r['used']} / {r['cache']} | " + " | ".join(cells) + (f" | {floor:.2f} |" if floor else " |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen3-30b-a3b", "llama-3.1-70b-tp8"],
                   choices=sorted(SHAPES))
    p.add_argument("--cache", nargs="+", default=["256:200", "2048:1024", "8192:4096"],
                   help="max_cache_len:written positions pairs")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", nargs="*", type=int, default=[], metavar="SPLITS",
                   help="also time the kernel at these splits per key / value head (JSON and stderr only)")
    p.add_argument("--fp8", action="store_true", help="also over an FP8 cache (codes and per-head scales)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, wall clock: a smoke test")
    args = p.parse_args(argv)
    if args.dry_run:
        device, label, shapes, caches, bw = "cpu", "CPU dry run (wall clock; not a measurement)", ["tiny"], \
            [(64, 40)], None
    elif torch.cuda.is_available():
        device, label, shapes, bw = "cuda", device_label("cuda"), args.shapes, None
        caches = [tuple(int(x) for x in c.split(":")) for c in args.cache]
        bw = bandwidth_gbps(device)
    else:
        sys.exit("bench_attention.py times CUDA graphs: run it on a GPU (or --dry-run on the CPU)")
    dtype = torch.bfloat16
    rows = []
    with torch.no_grad():
        for shape in shapes:
            for batch in args.batch:
                for cache, used in caches:
                    rows.append(case(shape, batch, cache, used, device, dtype, args.dry_run, args.sweep, args.fp8))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{label}; bf16; read bandwidth {bw:.0f} GB/s" if bw else label)
    print(markdown(rows, bw))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=label, bandwidth_gbs=bw, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
