"""A checkpoint's files, read safely: JSON configs, the shard index and every safetensors header are
validated completely before transformers reads any tensor data.

Nothing a file merely claims is allocated or read: a header length is bounded by the file's size and
safetensors' 100 MB limit before the header is read, tensor sizes are arithmetic on the header, and
every data range must lie inside the file. Shards named by an index must stay inside the checkpoint
directory (by realpath) and hold exactly the tensors the index gives them. Every problem is a
:class:`~qcompile.errors.CheckpointError` (a config file: :class:`~qcompile.errors.ConfigError`)
naming the file, the entry and the fix.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError, ConfigError, QCompileError, UnsupportedError

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header
MAX_DIMS = 64  # torch's limit on a tensor's dimensions
MAX_JSON_DEPTH = 64  # real configs nest a handful of levels; deeper input is refused, never recursed into
INDEX_SUFFIX = ".safetensors.index.json"
REEXPORT = "re-export or re-download the checkpoint"

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8),
}

Header = dict[str, tuple[torch.dtype, tuple[int, ...]]]


# -- JSON ----------------------------------------------------------------------------------------

def parse_json(text: str | bytes, where: str, what: str, error: type[QCompileError] = ConfigError) -> dict:
    """``text`` parsed as a JSON object no deeper than MAX_JSON_DEPTH, without duplicate keys."""
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise error(f"{what} nests too deeply to parse", where=where, fix=f"repair the file; {REEXPORT}") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and the duplicate-key check are ValueErrors
        raise error(f"{what} is not valid JSON ({e})", where=where, fix=f"repair the file; {REEXPORT}") from None
    if not isinstance(value, dict):
        raise error(f"{what} must be a JSON object, got a JSON {type(value).__name__}", where=where,
                    fix=f"repair the file; {REEXPORT}")
    if _depth(value) > MAX_JSON_DEPTH:
        raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", where=where,
                    fix=f"repair the file; {REEXPORT}")
    return value


def read_json(path: str, what: str, error: type[QCompileError] = ConfigError) -> dict:
    """The JSON object in file ``path`` (``what`` names it in errors)."""
    return parse_json(_read_bytes(path, error), path, what, error)


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r:.80}")
    return dict(pairs)


def _depth(value) -> int:
    depth, level = 0, [value]
    while level and depth <= MAX_JSON_DEPTH:
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)
                 if isinstance(c, (dict, list))]
    return depth


# -- one safetensors file ------------------------------------------------------------------------

def read_safetensors_header(path: str) -> Header:
    """``{tensor: (dtype, shape)}`` of one safetensors file after validating it completely: header
    length, JSON, every entry's dtype / shape / data_offsets, offsets contiguous and ending exactly at
    the end of the file; then safetensors itself opens it. No tensor data is read."""
    if not str(path).endswith(".safetensors"):
        raise UnsupportedError(f"{os.path.basename(path)} is not a safetensors file", where=str(path),
                              fix="quantized checkpoints must be saved as safetensors")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = _header_length(f.read(8), size, path)
            meta = parse_json(f.read(n), path, "the safetensors header", CheckpointError)
    except OSError as e:
        raise CheckpointError(f"cannot read the file ({e.strerror})", where=str(path),
                              fix="check the path and its permissions") from None
    header, spans = {}, []
    for name, info in meta.items():
        if name == "__metadata__":
            _check_metadata(info, path)
            continue
        dtype, shape, span = _entry(name, info, path)
        header[name] = (dtype, shape)
        spans.append((*span, name))
    _check_spans(spans, size - 8 - n, path)
    _open_with_safetensors(path, header)
    return header


def _header_length(raw: bytes, size: int, path: str) -> int:
    if len(raw) < 8:
        raise CheckpointError(f"the file is {size} bytes, too short for the 8-byte header length", where=path,
                              fix=f"the file is truncated or not safetensors; {REEXPORT}")
    (n,) = struct.unpack("<Q", raw)
    if not 2 <= n <= min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(f"the header length field says {n} bytes; the file has {size - 8} bytes after it "
                              f"(a header takes 2 to {MAX_HEADER_BYTES} bytes)", where=path,
                              fix=f"the file is truncated or corrupt; {REEXPORT}")
    return n


def _check_metadata(info, path: str) -> None:
    if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        raise CheckpointError(f"__metadata__ must map names to strings, got {info!r:.80}", where=path, fix=REEXPORT)


def _entry(name: str, info, path: str) -> tuple[torch.dtype, tuple[int, ...], tuple[int, int]]:
    """One header entry's dtype, shape and data byte range, checked against each other."""
    where = f"tensor {name!r:.120}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: the entry is a JSON {type(info).__name__}, not an object", where=path,
                              fix=REEXPORT)
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise CheckpointError(f"{where}: the entry has no {' / '.join(missing)}", where=path, fix=REEXPORT)
    dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{where} has unknown dtype {info['dtype']!r:.40}", where=path,
                              fix=f"qcompile reads {sorted(SAFETENSORS_DTYPES)}; {REEXPORT}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r:.80} is not a list of at most {MAX_DIMS} non-negative "
                              "integers", where=path, fix=REEXPORT)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {offsets!r:.80} is not [begin, end] with 0 <= begin <= end",
                              where=path, fix=REEXPORT)
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(f"{where}: shape {shape} of {info['dtype']} takes {nbytes} bytes but data_offsets "
                              f"{offsets} span {offsets[1] - offsets[0]}", where=path, fix=REEXPORT)
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_spans(spans: list[tuple[int, int, str]], data_bytes: int, path: str) -> None:
    """The tensors' byte ranges must tile the data region exactly (what safetensors requires)."""
    end, last = 0, None
    for begin, stop, name in sorted(spans):
        if stop > data_bytes:
            raise CheckpointError(f"tensor {name!r:.120}'s data_offsets [{begin}, {stop}] run past the end of the "
                                  f"file's {data_bytes} data bytes", where=path,
                                  fix=f"the file is truncated or its header is corrupt; {REEXPORT}")
        if begin != end:
            what = (f"overlaps tensor {last!r:.120}" if begin < end else f"leaves {begin - end} unused bytes before it")
            raise CheckpointError(f"tensor {name!r:.120}'s data_offsets [{begin}, {stop}] {what}", where=path,
                                  fix=REEXPORT)
        end, last = stop, name
    if end != data_bytes:
        raise CheckpointError(f"the file has {data_bytes - end} bytes after its last tensor", where=path,
                              fix=f"the file is corrupt; {REEXPORT}")


def _open_with_safetensors(path: str, header: Header) -> None:
    """safetensors' own check of the file (it maps the file; reads no tensor data)."""
    try:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"safetensors cannot open the file ({e})", where=path, fix=REEXPORT) from None
    if keys != set(header):
        raise CheckpointError("safetensors reads other tensor names than the header holds", where=path, fix=REEXPORT)


# -- the directory, the index and the shards -------------------------------------------------------

def confinement_root(directory: str) -> str:
    """The folder a checkpoint's files must resolve into: the checkpoint directory, or for a
    HuggingFace cache snapshot (``.../snapshots/<revision>``, files linked into ``../../blobs``) the
    model's cache folder."""
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    return os.path.dirname(parent) if os.path.basename(parent) == "snapshots" else real


def confine(path: str, root: str, where: str) -> str:
    """The realpath of ``path``; refused unless it lies inside ``root``."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise CheckpointError(f"{path} resolves to {real}, outside the checkpoint directory {root}", where=where,
                              fix="every shard must be a file inside the checkpoint directory; fix the index or "
                                  "the link")
    return real


def index_weight_map(index_path: str) -> dict[str, str]:
    """The ``weight_map`` of a ``*.safetensors.index.json`` after checking its structure: a JSON object
    with a ``metadata`` object and a ``weight_map`` of tensor names to ``.safetensors`` file names."""
    index = read_json(index_path, "the shard index", CheckpointError)
    fix = 'write {"metadata": {...}, "weight_map": {"<tensor>": "<shard>.safetensors", ...}}'
    for key in ("metadata", "weight_map"):
        if not isinstance(index.get(key), dict):
            raise CheckpointError(f"{key} must be a JSON object, got {type(index.get(key)).__name__}",
                                  where=index_path, fix=fix)
    for name, shard in index["weight_map"].items():
        if not isinstance(shard, str) or not shard.endswith(".safetensors"):
            raise CheckpointError(f"weight_map[{name!r:.120}] is {shard!r:.80}, not a .safetensors file name",
                                  where=index_path, fix=fix)
    return index["weight_map"]


def read_index(index_path: str) -> dict[str, str]:
    """``{tensor: shard realpath}`` of a shard index (:func:`index_weight_map`), each shard a file
    inside the checkpoint directory."""
    weight_map = index_weight_map(index_path)
    directory = os.path.dirname(os.path.abspath(index_path))
    root = confinement_root(directory)
    shards: dict[str, str] = {}
    for name, shard in weight_map.items():
        if shard in shards:
            continue
        where = f"{index_path}: weight_map[{name!r:.120}]"
        if os.path.isabs(shard):
            raise CheckpointError(f"the shard {shard!r:.120} is an absolute path", where=where,
                                  fix="name shards relative to the checkpoint directory")
        shards[shard] = confine(os.path.join(directory, shard), root, where)
        if not os.path.isfile(shards[shard]):
            raise CheckpointError(f"the shard {shard!r:.120} does not exist", where=where,
                                  fix=f"download the missing shard; {REEXPORT}")
    return {name: shards[shard] for name, shard in weight_map.items()}


def _read_bytes(path: str, error: type[QCompileError] = CheckpointError) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise error(f"cannot read the file ({e.strerror})", where=path,
                    fix="check the path and its permissions") from None


def find_index(files: list[str], directory: str | None) -> str | None:
    """The ``*.safetensors.index.json`` (beside the files or in ``directory``) naming these files."""
    reals = {os.path.realpath(f) for f in files}
    folders = {os.path.dirname(os.path.abspath(f)) for f in files} | ({directory} if directory else set())
    for folder in sorted(folders):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            index = os.path.join(folder, name)
            if name.endswith(INDEX_SUFFIX) and _names_these_shards(index, reals):
                return index
    return None


def _names_these_shards(index: str, reals: set[str]) -> bool:
    try:
        names = set(index_weight_map(index).values())
    except CheckpointError:
        return False
    folder = os.path.dirname(index)
    return bool(names) and {os.path.realpath(os.path.join(folder, s)) for s in names} <= reals


def read_checkpoint(files: list[str] | None, index: str | None = None, root: str | None = None) -> Header:
    """``{tensor: (dtype, shape)}`` of a checkpoint's files (None: the shards ``index`` names): each
    confined to ``root`` (when given), each header validated, no tensor in two files, and with an
    ``index`` every tensor in the shard the index names for it."""
    weight_map = read_index(index) if index else None
    files = sorted(set(weight_map.values())) if files is None and weight_map else files
    if not files:
        raise CheckpointError("no checkpoint files were found", where="checkpoint",
                              fix="point qcompile at a directory with model.safetensors (or its shards)")
    where = index or str(files[0])
    reals = [confine(f, root, where) if root else os.path.realpath(f) for f in files]
    header: Header = {}
    owner: dict[str, str] = {}  # tensor -> the realpath of the file holding it
    for path, real in zip(files, reals):
        for name, entry in read_safetensors_header(str(path)).items():
            if name in owner:
                raise CheckpointError(f"tensor {name!r:.120} is stored in both {owner[name]} and {real}",
                                      where=where, fix="keep one copy of each tensor; re-shard the checkpoint")
            owner[name], header[name] = real, entry
    if weight_map is not None:
        _check_index_matches(weight_map, owner, index)
    return header


def _check_index_matches(weight_map: dict[str, str], owner: dict[str, str], index: str) -> None:
    fix = "regenerate the index from the shards"
    for name, real in owner.items():
        if weight_map.get(name) != real:
            named = f"names {weight_map[name]}" if name in weight_map else "does not list it"
            raise CheckpointError(f"tensor {name!r:.120} is stored in {real} but the index {named}", where=index,
                                  fix=fix)
    for name, shard in weight_map.items():
        if name not in owner:
            raise CheckpointError(f"the index names tensor {name!r:.120} in {shard}, which does not hold it",
                                  where=index, fix=f"{fix}, or restore the shard")


def read_checkpoint_dir(directory: str, variant: str | None = None) -> Header:
    """:func:`read_checkpoint` of a local checkpoint directory: its ``model.safetensors`` or the shards
    its ``model.safetensors.index.json`` names (``model.<variant>.safetensors...`` with a variant)."""
    stem = f"model.{variant}" if variant else "model"
    index, single = os.path.join(directory, stem + INDEX_SUFFIX), os.path.join(directory, stem + ".safetensors")
    root = confinement_root(directory)
    if os.path.lexists(single):  # transformers' order
        return read_checkpoint([single], None, root)
    if os.path.lexists(index):
        confine(index, root, index)
        return read_checkpoint(None, index, root)
    raise CheckpointError(f"no {stem}.safetensors or {stem}{INDEX_SUFFIX}", where=directory,
                          fix="point at a checkpoint directory saved as safetensors")
