"""FP8 linear benchmark: peers (bf16, raw _scaled_mm / F.scaled_mm) and qcompile::fp8_linear end to end.

Times are medians of CUDA-graph replays (each graph holds ``--calls`` back-to-back calls), in µs per
call. Every fp8_linear row includes its activation quantization; the "pre-quantized" peer rows do not.
Floors: memory = (weight + x + out bytes) / ``--tbps``; compute = 2·M·N·K / ``--peak-tflops``.

    qcompile bench --out bench.json   (or python benchmarks/bench_fp8_linear.py ...) [--n 8192 --k 8192 --m 1 16 128 4096] [--probe]

``--probe`` adds the measurements behind two constants of qcompile/kernels/fp8.py: at which M the
block recipe runs in cuBLASLt (BLOCK_MIN_ROWS / BLOCK_ROW_MULTIPLE) and where RowWise _scaled_mm
overtakes TensorWise + epilogue for per-token x per-channel (ROWWISE_MIN_M).
The CLI ``qcompile bench`` calls :func:`run` with the namespace of :func:`add_arguments`.

:func:`greedy_decode` and :func:`device_label` time decoding for ``qcompile run``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

RECIPES = [  # (weight, activation) of fp8_scheme
    ("tensor", "static_tensor"),
    ("tensor", "dynamic_tensor"),
    ("channel", "static_tensor"),
    ("channel", "dynamic_token"),
    ("block", "dynamic_group"),
    ("block", "dynamic_token"),
]


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--n", type=int, default=8192, help="out_features of the weight (default: %(default)s)")
    p.add_argument("--k", type=int, default=8192, help="in_features of the weight (default: %(default)s)")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 128, 4096],
                   help="rows of x (tokens) to time, one table column each (default: 1 16 128 4096)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                   help="activation and output dtype (default: %(default)s)")
    p.add_argument("--calls", type=int, default=20, help="calls captured per CUDA graph (default: %(default)s)")
    p.add_argument("--replays", type=int, default=25,
                   help="timed graph replays; the median is reported (default: %(default)s)")
    p.add_argument("--tbps", type=float, default=3.0,
                   help="memory bandwidth in TB/s for the memory floor (default: %(default)s)")
    p.add_argument("--peak-tflops", type=float, default=1979.0,
                   help="fp8 dense peak for the compute floor (H100 SXM datasheet: 1979)")
    p.add_argument("--probe", action="store_true", help="also probe block-recipe M limits and the RowWise crossover")
    p.add_argument("--out", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    return p


def graph_time_us(fn, calls: int, replays: int) -> float:
    """Median µs per call of ``fn`` replayed from a CUDA graph of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def wall_us(fn, calls: int = 5) -> float:
    """Median wall-clock µs of ``calls`` calls (the benchmarks' CPU dry runs)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _try(fn, calls, replays):
    try:
        return round(graph_time_us(fn, calls, replays), 1)
    except Exception as e:  # noqa: BLE001 - a peer that does not run is a result, not a crash
        torch.cuda.synchronize()
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _weights(n, k, device):
    from qcompile.kernels import quant_math
    from qcompile.scheme import Granularity

    w = torch.randn(n, k, device=device) / k**0.5
    return w, {name: quant_math.quantize_weight_fp8(w, g) for name, g in
               (("tensor", Granularity.TENSOR), ("channel", Granularity.CHANNEL), ("block", Granularity.BLOCK))}


def _op_fn(x, wq, ws, input_scale, scheme, backend):
    op = torch.ops.qcompile.fp8_linear
    return lambda: op(x, wq, ws, input_scale, None, scheme, backend)


def bench_shape(args, n, k, m, dtype, weights, wbf16):
    from qcompile.kernels import fp8
    from qcompile.kernels import fp8_quant_triton as fq
    from qcompile.scheme import fp8_scheme

    dev = "cuda"
    x = (torch.randn(m, k, device=dev) * 2).to(dtype)
    rows = {}
    c, r = args.calls, args.replays
    rows["bf16 F.linear"] = _try(lambda: F.linear(x, wbf16), c, r)
    wq_t, ws_t = weights["tensor"]
    wq_c, ws_c = weights["channel"]
    wq_b, ws_b = weights["block"]
    xq, xs = fq.quantize_dynamic_tensor(x)
    rows["_scaled_mm tensorwise (x pre-quantized)"] = _try(
        lambda: torch._scaled_mm(xq, wq_t.t(), xs, ws_t, out_dtype=dtype), c, r)
    xq_tok, xs_tok = fq.quantize_dynamic_token(x)
    sb_row = ws_c.reshape(1, n)
    rows["_scaled_mm rowwise (x pre-quantized)"] = _try(
        lambda: torch._scaled_mm(xq_tok, wq_c.t(), xs_tok, sb_row, out_dtype=dtype), c, r)
    xq_g, xs_g = fq.quantize_dynamic_group(x, 128)
    sb_blk = ws_b.contiguous().t()
    rows["F.scaled_mm block 1x128 x 128x128 (x pre-quantized)"] = _try(
        lambda: F.scaled_mm(xq_g, wq_b.t(), xs_g, F.ScalingType.BlockWise1x128, sb_blk,
                            F.ScalingType.BlockWise128x128, output_dtype=dtype), c, r)
    # activation quantization alone (what the end-to-end rows add)
    static_scale = (x.abs().amax() / 448.0).float()
    # the fair peers: what a user writes with torch ops (quantize x, then _scaled_mm), same recipe
    fp8_max = torch.tensor(448.0, device=dev)

    def peer_static():
        q = (x.float() / static_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return torch._scaled_mm(q, wq_t.t(), static_scale, ws_t, out_dtype=dtype)

    def peer_token():
        s = (x.float().abs().amax(-1, keepdim=True) / fp8_max).clamp(min=1e-12)
        q = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        return torch._scaled_mm(q, wq_c.t(), s, sb_row, out_dtype=dtype)

    rows["peer: torch quant + _scaled_mm tensorwise (static x)"] = _try(peer_static, c, r)
    rows["peer: torch quant + _scaled_mm rowwise (dynamic token)"] = _try(peer_token, c, r)
    rows["quant only: static tensor"] = _try(lambda: fq.quantize_static_tensor(x, static_scale), c, r)
    rows["quant only: dynamic tensor (2 launches)"] = _try(lambda: fq.quantize_dynamic_tensor(x), c, r)
    rows["quant only: dynamic token"] = _try(lambda: fq.quantize_dynamic_token(x), c, r)
    rows["quant only: dynamic group128 (block rows)"] = _try(
        lambda: fq.quantize_dynamic_group(x, 128, rows=fp8._block_rows(m)), c, r)
    backends = ["scaled_mm"] + (["flashinfer"] if _flashinfer_ok() else [])
    for weight, act in RECIPES:
        scheme = fp8_scheme(weight, act)
        wq, ws = weights[weight]
        in_s = static_scale if act == "static_tensor" else None
        for backend in backends:
            kern = {"scaled_mm": fp8.FP8_SCALED_MM, "flashinfer": fp8.FP8_FLASHINFER}[backend]
            from qcompile.kernels.registry import KernelQuery
            why = kern.reason_not(KernelQuery(scheme, "cuda", torch.cuda.get_device_capability(), n, k, dtype))
            name = f"fp8_linear {weight} x {act} [{backend}]"
            rows[name] = f"not run: {why}" if why else _try(_op_fn(x, wq, ws, in_s, scheme.key, backend), c, r)
    return rows


def _flashinfer_ok() -> bool:
    try:
        import flashinfer  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def probe(args, n, k, dtype, weights):
    """Where the block recipe runs, and the RowWise / TensorWise+epilogue crossover."""
    from qcompile.kernels import fp8
    from qcompile.kernels import fp8_quant_triton as fq
    from qcompile.scheme import fp8_scheme

    out = {"block_raw_m": {}, "block_k_layout": {}, "rowwise_vs_epilogue": {}}
    wq_b, ws_b = weights["block"]
    for m in list(range(1, 17)) + [31, 33, 300, 301, 302, 303]:
        x = torch.randn(m, k, device="cuda").to(dtype)
        xq, xs = fq.quantize_dynamic_group(x, 128)
        try:
            F.scaled_mm(xq, wq_b.t(), xs, F.ScalingType.BlockWise1x128, ws_b.contiguous().t(),
                        F.ScalingType.BlockWise128x128, output_dtype=dtype)
            torch.cuda.synchronize()
            out["block_raw_m"][m] = "ok"
        except Exception as e:  # noqa: BLE001
            out["block_raw_m"][m] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    # K/128 not a multiple of 4: is scale_b the plain transpose, or padded to 4 k-blocks?
    from qcompile.kernels import quant_math
    from qcompile.scheme import Granularity
    for kk in (384, 640):
        w = torch.randn(256, kk, device="cuda") / kk**0.5
        wq, ws = quant_math.quantize_weight_fp8(w, Granularity.BLOCK)
        x = torch.randn(16, kk, device="cuda").to(dtype)
        xq, xs = fq.quantize_dynamic_group(x, 128)
        emu = torch.ops.qcompile.fp8_linear(x, wq, ws, None, None, fp8_scheme("block", "dynamic_group").key,
                                            "emulated").float()
        kb = kk // 128
        padded = torch.zeros(ws.shape[0], -(-kb // 4) * 4, device="cuda")
        padded[:, :kb] = ws
        for name, sb in (("transpose [N/128,K/128]", ws.contiguous().t()),
                         ("padded [N/128,roundup4]^T sliced", padded.t()[:kb]),
                         ("padded [N/128,roundup4]^T full", padded.t())):
            try:
                y = F.scaled_mm(xq, wq.t(), xs, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                                output_dtype=dtype).float()
                out["block_k_layout"][f"K={kk} {name}"] = f"ok, rel err {((y - emu).norm() / emu.norm()).item():.2e}"
            except Exception as e:  # noqa: BLE001
                out["block_k_layout"][f"K={kk} {name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    wq_c, ws_c = weights["channel"]
    key = fp8_scheme("channel", "dynamic_token").key
    saved = fp8.ROWWISE_MIN_M
    try:
        for m in (1, 8, 16, 32, 64, 96, 128, 256):
            x = torch.randn(m, k, device="cuda").to(dtype)
            res = {}
            for label, threshold in (("rowwise", 0), ("tensorwise+epilogue", 1 << 30)):
                fp8.ROWWISE_MIN_M = threshold  # read when the graph is captured
                res[label] = _try(_op_fn(x, wq_c, ws_c, None, key, "scaled_mm"), args.calls, args.replays)
            out["rowwise_vs_epilogue"][m] = res
    finally:
        fp8.ROWWISE_MIN_M = saved
    return out


def floors(args, n, k, m, dtype_bytes=2):
    fp8_bytes = n * k + m * k * dtype_bytes + m * n * dtype_bytes
    bf16_bytes = 2 * n * k + m * k * dtype_bytes + m * n * dtype_bytes
    return {
        "memory floor fp8 weights (µs)": round(fp8_bytes / (args.tbps * 1e12) * 1e6, 1),
        "memory floor bf16 weights (µs)": round(bf16_bytes / (args.tbps * 1e12) * 1e6, 1),
        f"fp8 compute floor @ {args.peak_tflops:g} TF/s (µs)": round(2 * m * n * k / (args.peak_tflops * 1e12) * 1e6, 1),
    }


def markdown(results, ms) -> str:
    names = list(dict.fromkeys(name for m in ms for name in results["times"][str(m)]))
    lines = ["| variant | " + " | ".join(f"M={m}" for m in ms) + " |", "| --- |" + " --- |" * len(ms)]
    for name in names:
        cells = []
        for m in ms:
            v = results["times"][str(m)].get(name, "")
            cells.append(f"{v}" if isinstance(v, float) else (v.split(":")[0] if v else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> dict:
    if not torch.cuda.is_available():
        from .errors import UnsupportedError
        raise UnsupportedError(f"this machine has no CUDA GPU (torch {torch.__version__}); the benchmark times "
                               "CUDA kernels", where="qcompile bench",
                               fix="run it on a machine with an NVIDIA GPU and a CUDA build of torch")
    import qcompile.kernels.fp8  # noqa: F401  (registers qcompile::fp8_linear)

    t0 = time.time()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    n, k = args.n, args.k
    wbf16, weights = _weights(n, k, "cuda")
    wbf16 = wbf16.to(dtype)
    results = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
               "torch": torch.__version__, "n": n, "k": k, "dtype": args.dtype, "unit": "µs per call (median)",
               "times": {}}
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    for m in args.m:
        rows = bench_shape(args, n, k, m, dtype, weights, wbf16)
        rows.update(floors(args, n, k, m))
        results["times"][str(m)] = rows
        torch.cuda.empty_cache()
    if args.probe:
        results["probe"] = probe(args, n, k, dtype, weights)
    results["seconds"] = round(time.time() - t0, 1)
    table = markdown(results, args.m)
    results["table"] = table
    print(f"{results['device']} (sm_{''.join(map(str, results['capability']))}), torch {results['torch']}, "
          f"triton {results['triton']}, N={n} K={k} {args.dtype}; µs per call, CUDA-graph replay median")
    print(table)
    for m in args.m:
        for name, v in results["times"][str(m)].items():
            if isinstance(v, str):
                print(f"  M={m} {name}: {v}")
    if args.probe:
        print(json.dumps(results["probe"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"done in {results['seconds']} s")
    return results


def device_label(device: torch.device | str) -> str:
    """What timings were measured on: the GPU's name, or the CPU and its torch threads."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    import platform
    threads = torch.get_num_threads()
    return (f"CPU {platform.processor() or platform.machine()}, {threads} thread{'s' * (threads != 1)} "
            f"(torch {torch.__version__})")


def greedy_decode(model, step, ids: torch.Tensor, new_tokens: int, warmup: int = 2):
    """Greedy decoding of batch 1 with a transformers StaticCache (:func:`kv_cache.static_cache`): the prompt
    ``ids`` runs through ``model`` (eager), every further token through ``step`` (the model's forward,
    compiled). Returns the ``new_tokens`` tokens ([1, new_tokens]) and the decode rate in tokens/s over the
    steps after the first ``warmup`` (which compile and capture), or None when no step is left to time."""
    from .kv_cache import cache_kwargs, static_cache

    n_prompt, dev = ids.shape[1], ids.device
    cache = cache_kwargs(model, static_cache(model, n_prompt + new_tokens))  # compiles once, sliding windows too
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = None
    with torch.no_grad():
        logits = model(input_ids=ids, cache_position=torch.arange(n_prompt, device=dev), use_cache=True,
                       **cache).logits
        tokens = [logits[:, -1:].argmax(-1)]
        for i in range(new_tokens - 1):
            if i == warmup:
                sync()
                t0 = time.perf_counter()
            logits = step(input_ids=tokens[-1], cache_position=torch.tensor([n_prompt + i], device=dev),
                          use_cache=True, **cache).logits
            tokens.append(logits[:, -1:].argmax(-1))
        sync()
    rate = (new_tokens - 1 - warmup) / (time.perf_counter() - t0) if t0 is not None else None
    return torch.cat(tokens, dim=1), rate


def main(argv=None) -> int:
    """``python benchmarks/bench_fp8_linear.py ...``: the same as ``qcompile bench ...``."""
    from .cli import main as cli_main
    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
