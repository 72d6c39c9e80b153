"""``qcompile::fp8_gemv``: an FP8 W8A8 matmul of a few rows, on the weight as cuBLAS reads it.

    out[m, n] = (sum_k xq[m, k] * w[n, k]) * x_scale[m] * w_scale[n] (+ bias[n]) -> out_dtype

``xq`` float8_e4m3fn ``[M, K]`` (the activations, already quantized), ``w`` float8_e4m3fn ``[N, K]`` (the
``nn.Linear`` layout: the same tensor ``torch._scaled_mm`` takes as ``w.t()``, so no second layout), ``x_scale``
fp32 ``[]`` or ``[M]``, ``w_scale`` fp32 ``[]`` or ``[N]``, ``bias`` ``[N]`` or None. The products of two e4m3
values are exact in fp32 and are summed in fp32; the scales and bias apply once to the sum, then one rounding.

On CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``) one Triton kernel: each program takes ``BLOCK_N``
weight rows of one row of x over all of K, so each weight row streams once per row of x, contiguous along K; x is
read alongside through a pointer tensor of the weight tile's shape (the repeats hit L1) so that both land in one
register layout; the multiply-adds run on the CUDA cores into per-thread partial sums that are reduced across K
once, after the loop. No split over K: the grid is N / BLOCK_N x M programs. It launches with programmatic
dependent launch on sm_90+ (``QCOMPILE_PDL=0`` turns it off). Elsewhere the op is :func:`reference`.

Which shapes it serves is measured, not ruled: ``fp8_inductor`` (``qcompile/kernels/fp8.py``) calls it in place
of ``torch._scaled_mm`` only where the tuning tables (:mod:`wo_tune`: the on-disk cache, then the table shipped
for the GPU) hold a ``gemv`` entry for that (N, K, M), and the op runs the launch that entry names.
``benchmarks/bench_fp8_gemv.py --table`` times the launches against ``torch._scaled_mm`` and writes the entries.
Shapes with no entry keep cuBLASLt (the best launch differs by shape: the default one beat cuBLASLt on 4 of the
14 shapes measured on an H200); the backend option ``fp8_gemv=False`` keeps it everywhere. The activation quantization stays in the
graph, fused into the kernel that produces x. No gradient: the op takes fp8 codes (``fp8_linear``'s own gradient
is the straight-through one).
"""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from . import cuda_driver, wo_tune
from .fp8_quant_triton import HAS_TRITON, interpreting, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8_quant_triton import _pdl_start
    from .wo_gemm_triton import _fp8_value

OP = "qcompile::fp8_gemv"
FP8 = torch.float8_e4m3fn
MAX_M = 1  # rows fp8_linear's "gemv" backend sends to the kernel (each row streams the weight once more)
LAUNCH = dict(block_n=16, block_k=512, num_warps=4, num_stages=3)  # when neither the caller nor a table names one
ACC_REGISTERS = 64  # fp32 partial sums a thread may hold: BLOCK_N * BLOCK_K / threads (more spill)


def acc_registers(block_n: int, block_k: int, num_warps: int) -> int:
    return block_n * block_k // (32 * num_warps)


def table_key(n: int, k: int, m: int) -> str:
    """The key of the GEMV's choice at M rows of an [N, K] weight in the tuning tables (:mod:`wo_tune`): route
    ``gemv`` with its launch, or ``scaled_mm`` where cuBLASLt was faster."""
    return f"fp8_gemv|{n}x{k}|m{m}"


@functools.lru_cache(maxsize=1024)
def _chosen(device: int, n: int, k: int, m: int) -> dict | None:
    choice = wo_tune.lookup(cuda_driver.device_name(device), table_key(n, k, m))
    return dict(choice.launch) if choice is not None and choice.route == "gemv" else None


def chosen(n: int, k: int, m: int, x: torch.Tensor) -> dict | None:
    """The launch the tables measured fastest for this shape on ``x``'s GPU, or None where they have no entry or
    cuBLASLt won (``fp8_inductor`` then keeps ``torch._scaled_mm``). :func:`forget` after a table changes."""
    if not x.is_cuda:
        return None
    return _chosen(cuda_driver.device_index(x.device), n, k, m)


def forget() -> None:
    """Read the tables again at the next :func:`chosen`."""
    wo_tune.clear()
    _chosen.cache_clear()


if HAS_TRITON:
    @triton.jit
    def _gemv_kernel(X, W, XS, WS, B, OUT, N, K, stride_xm, stride_wn, stride_om,
                     X_VEC: tl.constexpr, W_VEC: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
        _pdl_start(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1)  # one row of x per program: the row count a GEMV serves is too small for a tile
        n_ok = rows < N
        # products summed elementwise over the K steps, reduced across K once after the loop: no shuffles or
        # barriers inside it (BLOCK_N * BLOCK_K / threads fp32 registers per thread: ACC_REGISTERS)
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            # x through a pointer tensor of the weight tile's shape (stride 0 along N; the repeated reads hit
            # L1), so that both arrive in one register layout: no exchange through shared memory in the loop
            w = tl.load(W + rows[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            x = tl.load(X + m * stride_xm + rows[:, None] * 0 + kk[None, :], mask=k_ok[None, :], other=0)
            part += _fp8_value(w, NATIVE) * _fp8_value(x, NATIVE)
        acc = tl.sum(part, axis=1)
        acc = acc * (tl.load(XS + m) if X_VEC else tl.load(XS))
        if W_VEC:
            acc = acc * tl.load(WS + rows, mask=n_ok, other=0.0)
        else:
            acc = acc * tl.load(WS)
        if HAS_BIAS:
            acc += tl.load(B + rows, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(OUT + m * stride_om + rows, acc.to(OUT.dtype.element_ty), mask=n_ok)


def _check(xq, weight, x_scale, weight_scale, bias):
    m, k = xq.shape if xq.dim() == 2 else (None, None)
    n = weight.shape[0] if weight.dim() == 2 else None
    problems = []
    if xq.dim() != 2 or xq.dtype != FP8:
        problems.append(f"xq must be float8_e4m3fn [M, K], got {xq.dtype} {list(xq.shape)}")
    if weight.dim() != 2 or weight.dtype != FP8 or (k is not None and weight.shape[1] != k):
        problems.append(f"weight must be float8_e4m3fn [N, K={k}], got {weight.dtype} {list(weight.shape)}")
    if x_scale.dtype != torch.float32 or x_scale.shape not in ((), (m,)):
        problems.append(f"x_scale must be fp32 [] or [M={m}], got {x_scale.dtype} {list(x_scale.shape)}")
    if weight_scale.dtype != torch.float32 or weight_scale.shape not in ((), (n,)):
        problems.append(f"weight_scale must be fp32 [] or [N={n}], got {weight_scale.dtype} "
                        f"{list(weight_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        problems.append(f"bias must be [N={n}], got {list(bias.shape)}")
    if problems:
        raise UnsupportedError("; ".join(problems), where=OP)


def reference(xq, weight, x_scale, weight_scale, bias, out_dtype):
    """The op's math in fp32 on any device."""
    acc = xq.float() @ weight.float().t()
    acc = acc * (x_scale.reshape(-1, 1) if x_scale.dim() else x_scale) * weight_scale
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def _triton(xq, weight, x_scale, weight_scale, bias, out_dtype, launch=None):
    (m, k), n = xq.shape, weight.shape[0]
    cfg = {**LAUNCH, **(launch or chosen(n, k, m, xq) or {})}
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    native = xq.is_cuda and not interpreting()
    _gemv_kernel[(triton.cdiv(n, cfg["block_n"]), m)](
        xq.view(torch.uint8), weight.view(torch.uint8), x_scale, weight_scale, weight_scale if bias is None else bias,
        out, n, k, xq.stride(0), weight.stride(0), out.stride(0), X_VEC=x_scale.dim() == 1,
        W_VEC=weight_scale.dim() == 1, HAS_BIAS=bias is not None, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        NATIVE=native, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl(xq))
    return out


@torch.library.custom_op(OP, mutates_args=())
def fp8_gemv(xq: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq @ weight.T) * x_scale * weight_scale (+ bias) in ``out_dtype`` (module doc)."""
    _check(xq, weight, x_scale, weight_scale, bias)
    if use_triton(xq):
        return _triton(xq, weight, x_scale, weight_scale, bias, out_dtype)
    return reference(xq, weight, x_scale, weight_scale, bias, out_dtype)


@fp8_gemv.register_fake
def _(xq, weight, x_scale, weight_scale, bias, out_dtype):
    _check(xq, weight, x_scale, weight_scale, bias)
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


def runs(x: torch.Tensor) -> bool:
    """Whether the kernel (not the reference) runs for tensors like ``x``."""
    return use_triton(x)


def fingerprint(device: torch.device) -> str:
    """A digest of the GEMV's table entries for ``device``'s GPU (what :func:`chosen` answers from): the backend
    puts it in inductor's cache key, so that a graph compiled before a table changed is not reused."""
    import hashlib
    import json

    name = cuda_driver.device_name(cuda_driver.device_index(device))
    entries = {f"{where}:{key}": choice.to_json() for where in ("shipped", "cache")
               for key, choice in wo_tune.table(where, name).items() if key.startswith("fp8_gemv|")}
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]
