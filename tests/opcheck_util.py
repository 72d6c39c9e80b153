"""torch.library.opcheck for ops that take fp8 tensors.

opcheck's ``test_schema`` compares inputs before and after the call with a multiply, which torch does
not implement for fp8 on the CPU ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'). For
such ops we run every other opcheck test and check "no input mutated" ourselves, on the raw bytes.
"""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def opcheck(op, args, kwargs=None):
    kwargs = kwargs or {}
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if not any(t.dtype in FP8 for t in tensors):
        return torch.library.opcheck(op, args, kwargs)
    before = [t.detach().clone().view(torch.uint8) if t.dtype in FP8 else t.detach().clone() for t in tensors]
    op(*args, **kwargs)
    for t, b in zip(tensors, before):
        now = t.view(torch.uint8) if t.dtype in FP8 else t
        assert torch.equal(now, b), "the op mutated an input it declares as read-only"
    return torch.library.opcheck(op, args, kwargs,
                                 test_utils=("test_autograd_registration", "test_faketensor",
                                             "test_aot_dispatch_dynamic"))
