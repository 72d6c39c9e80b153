"""CUDA driver plumbing for the kernels compiled at run time: NVRTC, module load, occupancy queries,
tensor maps, ``cuLaunchKernelEx`` with programmatic dependent launch, zeroed scratch buffers.

Everything goes through the libraries PyTorch's CUDA build already loads (``libnvrtc`` and
``libcuda`` via ``torch.cuda._utils``): no CUDA toolkit, C++ compiler or ninja is needed.
``QCOMPILE_NVRTC`` may name another ``libnvrtc.so`` (to compile for a GPU the machine does not have,
e.g. to read the SASS). Device properties are queried once per process.
"""

from __future__ import annotations

import ctypes
import os

import torch


def _driver():
    from torch.cuda._utils import _get_gpu_runtime_library

    return _get_gpu_runtime_library()


# -- device properties -----------------------------------------------------------------------------

_CAP: dict[int, tuple[int, int]] = {}
_SMS: dict[int, int] = {}
_NAMES: dict[int, str] = {}


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(idx: int) -> tuple[int, int]:
    if idx not in _CAP:
        _CAP[idx] = torch.cuda.get_device_capability(idx)
    return _CAP[idx]


def sm_count(idx: int) -> int:
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def device_name(idx: int) -> str:
    if idx not in _NAMES:
        _NAMES[idx] = torch.cuda.get_device_name(idx)
    return _NAMES[idx]


# -- NVRTC -----------------------------------------------------------------------------------------

def _nvrtc() -> ctypes.CDLL:
    path = os.environ.get("QCOMPILE_NVRTC")
    if path:
        return ctypes.CDLL(path)
    from torch.cuda._utils import _get_gpu_rtc_library

    return _get_gpu_rtc_library()


def compile_cubin(src: str, arch: str, name: str, extra: tuple[str, ...] = ()) -> bytes:
    """NVRTC ``src`` for ``sm_<arch>``; the cubin. Compilation errors raise with NVRTC's log."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(rc).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None), "create")
    opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", *extra]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    if rc != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise RuntimeError(f"NVRTC compilation of {name} failed:\n{log.value.decode()}")
    size = ctypes.c_size_t()
    check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
    buf = ctypes.create_string_buffer(size.value)
    check(lib.nvrtcGetCUBIN(prog, buf), "cubin")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def load_module(cubin: bytes, names: list[str], idx: int) -> dict:
    """The kernels ``names`` of ``cubin`` loaded on device ``idx`` (objects with ``func``,
    ``set_shared_memory_config`` and ``_max_shared_mem_bytes``)."""
    from torch.cuda._utils import _cuda_load_module

    with torch.cuda.device(idx):
        return _cuda_load_module(cubin, names)


def with_shared_memory(kern, smem: int):
    """``kern`` allowed ``smem`` bytes of dynamic shared memory (opt-in above 48 KB)."""
    if smem > kern._max_shared_mem_bytes:
        kern.set_shared_memory_config(max(smem, 48 * 1024))
    return kern


# -- launch ----------------------------------------------------------------------------------------

class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def launch(kern, grid, block, smem: int, pdl: bool, args: list) -> None:
    """cuLaunchKernelEx on the current stream of the first tensor's device. With ``pdl`` the launch
    may begin while the previous kernel of the stream finishes (programmatic stream serialization);
    the kernel must wait for it (griddepcontrol.wait) before it reads that kernel's outputs. Tensors
    (and ctypes pointers) are passed as pointers, None as a null pointer, ints as int32, other ctypes values
    (a c_longlong, a tensor map) as they are."""
    held = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_void_p(None) if a is None
            else a if isinstance(a, (ctypes._SimpleCData, ctypes.Array)) else ctypes.c_int(a) for a in args]
    ptrs = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held])
    attr = _LaunchAttr(_PROGRAMMATIC_STREAM_SERIALIZATION, 0, (ctypes.c_int * 16)(1))
    stream = torch.cuda.current_stream(args[0].device)
    conf = _LaunchConfig(grid, block, smem, stream._as_parameter_,
                         ctypes.cast(ctypes.byref(attr), ctypes.c_void_p) if pdl else None, 1 if pdl else 0)
    rc = _driver().cuLaunchKernelEx(ctypes.byref(conf), kern.func, ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


def blocks_per_sm(kern, threads: int, smem: int) -> int:
    """CTAs of ``kern`` one SM holds at once (cuOccupancyMaxActiveBlocksPerMultiprocessor); 0 if the
    driver cannot say."""
    n = ctypes.c_int(0)
    rc = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), kern.func, threads,
                                                               ctypes.c_size_t(smem))
    return n.value if rc == 0 else 0


def max_active_clusters(kern, cluster: int, threads: int, smem: int) -> int:
    """How many clusters of ``cluster`` CTAs the GPU holds at once (cuOccupancyMaxActiveClusters; the
    kernel's cluster shape is compiled in); 0 if the driver cannot say."""
    conf = _LaunchConfig((1, cluster, 1), (threads, 1, 1), smem, None, None, 0)
    n = ctypes.c_int(0)
    rc = _driver().cuOccupancyMaxActiveClusters(ctypes.byref(n), kern.func, ctypes.byref(conf))
    return n.value if rc == 0 else 0


_TENSOR_MAP_U16, _SWIZZLE_128B, _L2_PROMOTION_256B = 1, 3, 3  # CUtensorMapDataType / Swizzle / L2promotion


def tensor_map_2d(t: torch.Tensor, box_cols: int, box_rows: int) -> ctypes.Array:
    """A TMA tensor map of a contiguous 16-bit [rows, cols] tensor (16-byte aligned): boxes of
    ``box_cols`` x ``box_rows``, 128-byte swizzled; rows past the end read as zeros. 128 bytes (a
    CUtensorMap), passed to a kernel by value."""
    rows, cols = t.shape
    tmap = (ctypes.c_uint64 * 16)()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = _driver().cuTensorMapEncodeTiled(
        ctypes.byref(tmap), _TENSOR_MAP_U16, u32(2), ctypes.c_void_p(t.data_ptr()), (u64 * 2)(cols, rows),
        (u64 * 1)(2 * cols), (u32 * 2)(box_cols, box_rows), (u32 * 2)(1, 1), 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (tensor {list(t.shape)}, "
                           f"box {box_cols} x {box_rows})")
    return tmap


# -- zeroed counters -------------------------------------------------------------------------------

_COUNTERS: dict[tuple[int, int], tuple[ctypes.c_void_p, int]] = {}  # (device, stream) -> (pointer, ints)
_SPARE: dict[int, tuple[ctypes.c_void_p, int]] = {}  # device -> a zeroed buffer for the next capture stream


def counters(device: torch.device, n: int) -> torch.Tensor | ctypes.c_void_p:
    """At least ``n`` zeroed int32 counters that each kernel using them leaves zero again.

    One buffer per (device, stream): launches on two streams may run at the same time and must not
    count each other's CTAs. Cached buffers come from cuMemAlloc, outside PyTorch's caching allocator:
    while torch.compile's cudagraph trees warm up, every allocation of the thread goes to the graphs'
    memory pool, which must not keep a tensor that outlives its graphs. No buffer can be allocated and
    zeroed while a stream is captured, so each allocation outside a capture sets a spare one aside,
    which the first capture on a stream without a buffer takes (graphs are usually captured on a stream
    that never runs eagerly). Without it the call gets its own zeroed tensor, and the graph replays
    that memset before every launch (a memset node, and the next kernel's early launch lost). Graphs
    captured on one stream and replayed at the same time on two streams still share their buffer."""
    idx = device_index(device)
    key = (idx, torch.cuda.current_stream(device).cuda_stream)
    have = _COUNTERS.get(key)
    if have is not None and have[1] >= n:
        return have[0]
    if torch.cuda.is_current_stream_capturing():
        spare = _SPARE.get(idx)
        if have is None and spare is not None and spare[1] >= n:
            _COUNTERS[key] = _SPARE.pop(idx)
            return spare[0]
        return torch.zeros(n, dtype=torch.int32, device=device)
    size = max(n, 16384)
    _COUNTERS[key] = _zeroed(idx, size, have)
    spare = _SPARE.get(idx)
    if spare is None or spare[1] < size:
        _SPARE[idx] = _zeroed(idx, size, spare)
    return _COUNTERS[key][0]


def _zeroed(idx: int, size: int, old: tuple[ctypes.c_void_p, int] | None) -> tuple[ctypes.c_void_p, int]:
    """A zeroed cuMemAlloc buffer of ``size`` int32 on device ``idx``, in place of ``old`` (freed)."""
    lib, ptr = _driver(), ctypes.c_void_p()

    def check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUresult {code} (split-K counters, {4 * size} bytes)")

    with torch.cuda.device(idx):
        check(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4 * size)), "cuMemAlloc")
        check(lib.cuMemsetD32_v2(ptr, ctypes.c_uint(0), ctypes.c_size_t(size)), "cuMemsetD32")
        check(lib.cuCtxSynchronize(), "cuCtxSynchronize")  # the zeros, and a replaced buffer's last launch
        if old is not None:
            check(lib.cuMemFree_v2(old[0]), "cuMemFree")
    return ptr, size
