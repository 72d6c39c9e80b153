"""Every checkpoint format compiles and runs in fp32, fp16 and bf16 on the CPU.

Each cell loads the 1-layer synthetic checkpoint with ``qcompile.load(path, dtype=...)``, runs one forward
of 8 tokens eagerly and one compiled, and compares the logits. The full matrix compiles with
``inner="aot_eager"``: it runs the backend's pass, the kernel ops' fake implementations and AOTAutograd,
the parts a dtype can break, in ~10 s a cell on 2 cores (Dynamo's trace of the model is most of it).
Inductor's C++ compile takes a minute or more a cell there, so three cells run with the default inner
compiler: one per activation dtype, each a different kernel family.

A kernel op that cannot take the activation dtype (``qcompile::wo_linear`` takes bf16 / fp16) is never
selected: the layer falls back to the reference op and the explain table says why.
"""

from __future__ import annotations

import pytest
import torch

import qcompile
from qcompile import synth
from qcompile.scheme import parse_scheme_key

from .passes.test_fuse_linears import requantized_like_fused

IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64]])
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FORMATS = [f for f in synth.FORMATS if f != "bf16"]
# Relative logits error vs the eager model. aot_eager: the weight-only kernel dequantizes to the
# activation dtype and multiplies there, where the reference multiplies in fp32 (bf16: ~1 %). inductor:
# also the norms / RoPE / softmax keep fp32 intermediates, which FP8 activation rounding amplifies
# (a few %, docs/design.md "Numerics").
# NVFP4 W4A4 (the CPU runs its faithful emulation) rounds activations to FP4, 8 magnitudes a sign, which amplifies
# more: 10.3 % under inductor in bf16 on an AVX-512 CPU.
TOLERANCE = {"aot_eager": 0.02, "inductor": 0.1}
INDUCTOR_CELLS = [("ct-w4a16", "fp32", 0.1), ("modelopt-fp8-pbwo", "fp16", 0.1), ("ct-nvfp4", "bf16", 0.15)]


def compile_and_compare(path, dtype: torch.dtype, inner: str, tol: float | None = None):
    model = qcompile.load(path, dtype=dtype)
    torch._dynamo.reset()  # a model of the same structure compiled earlier would be reused silently
    be = qcompile.backend(inner=inner)
    with torch.no_grad():
        out = torch.compile(model, backend=be)(IDS).logits
        want = requantized_like_fused(model)(IDS).logits  # fused q/k/v, gate/up: one per-tensor scale
    assert out.dtype == want.dtype == dtype and torch.isfinite(out).all()
    out, want = out.float(), want.float()
    rel = ((out - want).norm() / want.norm()).item()
    assert rel < (tol or TOLERANCE[inner]), rel
    assert len(be.rows) == 4, be.explain()  # q/k/v and gate/up fused (tests/passes/test_fuse_linears.py)
    if dtype == torch.float32:  # no kernel that takes bf16 / fp16 only, and the table says why
        for row in be.rows:
            assert not row.kernel.startswith("wo_"), row
            if parse_scheme_key(row.scheme).act is None:
                assert row.kernel == "reference", row
                assert "wo_dequant: needs bf16/fp16 activations, have torch.float32" in row.reason, row
    return be


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_compiles_in_every_dtype(one_layer, fmt, dtype):
    compile_and_compare(one_layer(fmt), DTYPES[dtype], "aot_eager")


@pytest.mark.parametrize("fmt,dtype,tol", INDUCTOR_CELLS)
def test_default_inner_compiler(one_layer, fmt, dtype, tol):
    compile_and_compare(one_layer(fmt), DTYPES[dtype], "inductor", tol)
