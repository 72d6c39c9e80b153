"""Reading checkpoint files safely (qcompile.checkpoint_files): every malformed or hostile safetensors
file, shard index and JSON config is refused with a CheckpointError / ConfigError naming the file and
the entry, before any tensor data is read and without allocating what a header claims; a hypothesis
fuzz corrupts real checkpoint files; loads from several threads stay correct."""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import qcompile
from qcompile.checkpoint_files import (MAX_HEADER_BYTES, SAFETENSORS_DTYPES, read_checkpoint_dir, read_json,
                                       read_safetensors_header)
from qcompile.errors import CheckpointError, ConfigError, QCompileError
from tests.formats import fuzz

REPO = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


# -- building and corrupting files -------------------------------------------------------------------

def split_header(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def pack(header: dict | list | bytes, data: bytes, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def by_offset(header: dict) -> list[str]:
    """Tensor names in data order."""
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def edit(fn):
    """A corruption that edits a copy of the header dict (``fn(header, names in data order)``)."""
    def corrupt(header, data):
        header = copy.deepcopy(header)
        fn(header, by_offset(header))
        return pack(header, data)
    return corrupt


def shift(entry: dict, delta: int) -> None:
    entry["data_offsets"] = [o + delta for o in entry["data_offsets"]]


# name: (corrupt(header, data) -> file bytes, text the error names)
FILE_CASES = {
    "header length 2**62": (lambda h, d: pack(h, d, 2**62), "says 4611686018427387904 bytes"),
    "header length 2**64-1": (lambda h, d: pack(h, d, 2**64 - 1), "says 18446744073709551615 bytes"),
    "header length past the end of the file": (lambda h, d: pack(h, d, len(json.dumps(h)) + len(d) + 1),
                                               "header length field"),
    "header length zero": (lambda h, d: pack(h, d, 0), "says 0 bytes"),
    "file shorter than 8 bytes": (lambda h, d: b"\x10\x00\x00", "too short for the 8-byte header length"),
    "truncated in the data region": (lambda h, d: pack(h, d[:-3]), "run past the end"),
    "data offsets past the end": (edit(lambda h, t: shift(h[t[-1]], 1 << 40)), "run past the end"),
    "overlapping data offsets": (edit(lambda h, t: shift(h[t[1]], -2)), "overlaps tensor"),
    "bytes after the last tensor": (lambda h, d: pack(h, d + bytes(8)), "8 bytes after its last tensor"),
    "header is a JSON array": (lambda h, d: pack(list(h), d), "got a JSON list"),
    "header is not JSON": (lambda h, d: pack(b"\xff\xfe{not json", d), "not valid JSON"),
    "header nested deeply": (lambda h, d: pack(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", d), "nests"),
    "duplicate tensor name": (lambda h, d: pack(
        json.dumps(h)[:-1].encode() + b", " + json.dumps(h)[1:].encode(), d), "duplicate key"),
    "entry without shape": (edit(lambda h, t: h[t[0]].pop("shape")), "has no shape"),
    "entry without dtype": (edit(lambda h, t: h[t[0]].pop("dtype")), "has no dtype"),
    "entry without data_offsets": (edit(lambda h, t: h[t[0]].pop("data_offsets")), "has no data_offsets"),
    "entry is not an object": (edit(lambda h, t: h.update({t[0]: [1, 2]})), "not an object"),
    "shape disagrees with the offsets": (edit(lambda h, t: h[t[0]]["shape"].insert(0, 3)), "bytes but data_offsets"),
    "shape claims 2**80 elements": (edit(lambda h, t: h[t[0]].update(shape=[2**40, 2**40])),
                                    "bytes but data_offsets"),
    "negative dimension": (edit(lambda h, t: h[t[0]].update(shape=[-1])), "non-negative"),
    "boolean dimension": (edit(lambda h, t: h[t[0]].update(shape=[True])), "non-negative"),
    "reversed data offsets": (edit(lambda h, t: h[t[0]].update(data_offsets=h[t[0]]["data_offsets"][::-1])),
                              "[begin, end]"),
    "unknown dtype": (edit(lambda h, t: h[t[0]].update(dtype="F7")), "unknown dtype 'F7'"),
    "dtype not a string": (edit(lambda h, t: h[t[0]].update(dtype=["F32"])), "unknown dtype"),
    "metadata not strings": (edit(lambda h, t: h.update(__metadata__={"format": 1})), "__metadata__"),
}


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("small") / "model.safetensors"
    save_file({"a": torch.arange(16.0).reshape(4, 4), "b": torch.arange(6, dtype=torch.int8),
               "c": torch.ones(2, 3, dtype=torch.bfloat16)}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def shard_checkpoint(src: Path, dst: Path) -> dict[str, str]:
    """Copy checkpoint ``src`` to ``dst`` with its tensors split over two shards and an index;
    returns the weight map."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    state = load_file(str(src / "model.safetensors"))
    weight_map = {name: SHARDS[i % 2] for i, name in enumerate(sorted(state))}
    for shard in SHARDS:
        save_file({k: v for k, v in state.items() if weight_map[k] == shard}, str(dst / shard),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return weight_map


def rewrite_index(fn):
    def corrupt(path: Path):
        index = json.loads((path / INDEX).read_text())
        fn(index, path)
        (path / INDEX).write_text(json.dumps(index))
    return corrupt


def move_outside(path: Path, shard: str) -> Path:
    outside = path.parent / "outside"
    outside.mkdir(exist_ok=True)
    return Path(shutil.move(str(path / shard), str(outside / shard)))


def redirect(index: dict, shard: str, to: str) -> None:
    index["weight_map"] = {k: (to if v == shard else v) for k, v in index["weight_map"].items()}


def first_of(index: dict, shard: str) -> str:
    return next(k for k, v in index["weight_map"].items() if v == shard)


def duplicate_tensor(path: Path):
    """A second, different copy of one of shard 1's tensors in shard 2 (transformers loads the last)."""
    name = first_of(json.loads((path / INDEX).read_text()), SHARDS[0])
    state = load_file(str(path / SHARDS[1]))
    state[name] = torch.zeros_like(load_file(str(path / SHARDS[0]))[name])
    save_file(state, str(path / SHARDS[1]), metadata={"format": "pt"})


def tensor_in_other_shard(path: Path):
    rewrite_index(lambda index, _: index["weight_map"].update({first_of(index, SHARDS[0]): SHARDS[1]}))(path)


def symlink_outside(path: Path):
    os.symlink(move_outside(path, SHARDS[1]), path / SHARDS[1])


# name: (corrupt(checkpoint dir), text the error names); every error also names the index or a shard.
INDEX_CASES = {
    "index is not JSON": (lambda p: (p / INDEX).write_text("{\"weight_map\": "), "not valid JSON"),
    "index is a JSON list": (lambda p: (p / INDEX).write_text("[]"), "got a JSON list"),
    "index without weight_map": (rewrite_index(lambda i, p: i.pop("weight_map")), "weight_map must be a JSON object"),
    "index without metadata": (rewrite_index(lambda i, p: i.pop("metadata")), "metadata must be a JSON object"),
    "weight_map entry not a string": (rewrite_index(lambda i, p: i["weight_map"].update(
        {first_of(i, SHARDS[0]): 5})), "not a .safetensors file name"),
    "missing shard": (lambda p: (p / SHARDS[1]).unlink(), f"the shard '{SHARDS[1]}' does not exist"),
    "shard outside the directory": (rewrite_index(lambda i, p: (move_outside(p, SHARDS[1]), redirect(
        i, SHARDS[1], f"../outside/{SHARDS[1]}"))), "outside the checkpoint directory"),
    "absolute shard path": (rewrite_index(lambda i, p: redirect(i, SHARDS[1], str(move_outside(p, SHARDS[1])))),
                            "is an absolute path"),
    "symlinked shard outside the directory": (symlink_outside, "outside the checkpoint directory"),
    "tensor in two shards": (duplicate_tensor, "is stored in both"),
    "tensor in another shard than the index names": (tensor_in_other_shard, "but the index names"),
    "index names a tensor no shard holds": (rewrite_index(lambda i, p: i["weight_map"].update(
        {"model.extra.weight": SHARDS[0]})), "which does not hold it"),
    "tensor the index does not list": (rewrite_index(lambda i, p: i["weight_map"].pop(first_of(i, SHARDS[1]))),
                                       "does not list it"),
}


@pytest.fixture(scope="module")
def sharded(synth_ckpt, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharded") / "ck"
    shard_checkpoint(synth_ckpt("modelopt-fp8"), path)
    return path


# -- file-level cases ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_malformed_safetensors_file(case, small_file, tmp_path):
    corrupt, text = FILE_CASES[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(corrupt(*split_header(small_file)))
    with pytest.raises(CheckpointError) as e:
        read_safetensors_header(str(path))
    msg = str(e.value)
    assert str(path) in msg and text in msg and "Fix:" in msg, msg


def test_valid_file_reads_dtypes_and_shapes(small_file, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(small_file)
    assert read_safetensors_header(str(path)) == {"a": (torch.float32, (4, 4)), "b": (torch.int8, (6,)),
                                                  "c": (torch.bfloat16, (2, 3))}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_malformed_shard_index(case, sharded, tmp_path):
    corrupt, text = INDEX_CASES[case]
    path = tmp_path / "ck"
    shutil.copytree(sharded, path)
    corrupt(path)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint_dir(str(path))
    msg = str(e.value)
    assert text in msg and (INDEX in msg or SHARDS[1] in msg) and "Fix:" in msg, msg


def test_sharded_checkpoint_loads_like_the_single_file(synth_ckpt, sharded):
    single = qcompile.load(str(synth_ckpt("modelopt-fp8")))
    model = qcompile.load(str(sharded))
    assert model.state_dict().keys() == single.state_dict().keys()
    for name, tensor in single.state_dict().items():
        assert torch.equal(model.state_dict()[name].float(), tensor.float()), name


@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json"])
def test_deeply_nested_json_config(name, tmp_path):
    path = tmp_path / name
    path.write_text('{"quantization_config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=name):
        read_json(str(path), name)
    path.write_text('{"a": ' + "[" * 70 + "]" * 70 + "}")  # parses, but deeper than any real config
    with pytest.raises(ConfigError, match="nests deeper than 64"):
        read_json(str(path), name)


# -- nothing claimed is allocated; the fuzz ----------------------------------------------------------------

def test_hostile_lengths_allocate_nothing(synth_ckpt, tmp_path):
    """In a child process whose address space is capped 256 MB above what it uses, hostile length
    fields and shapes are refused (an allocation of what they claim would fail the cap)."""
    src = synth_ckpt("modelopt-fp8")
    header, data = split_header((src / "model.safetensors").read_bytes())
    paths = []
    for i, length in enumerate([2**62, 2**64 - 1, MAX_HEADER_BYTES, len(json.dumps(header)) + len(data) + 1]):
        ck = tmp_path / f"ck{i}"
        shutil.copytree(src, ck)
        (ck / "model.safetensors").write_bytes(pack(header, data, length))
        paths.append(str(ck))
    script = (
        "import resource, sys\n"
        "import qcompile, transformers\n"
        "from transformers import AutoModelForCausalLM\n"
        "vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize')) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        qcompile.load(path)\n"
        "    except qcompile.CheckpointError as e:\n"
        "        assert 'header length field' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit(path + ' loaded')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", script, *paths], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


HEADER_WORDS = sorted(SAFETENSORS_DTYPES) + ["F7", "U16", "pt", "format"]
LENGTHS = st.sampled_from([0, 1, 2, 7, 2**31, 2**62, 2**64 - 1, MAX_HEADER_BYTES]) | st.integers(0, 2**64 - 1)


def draw_corruption(data, raw: bytes) -> bytes:
    """One corruption of safetensors file bytes ``raw``: a truncation, a new header length, bytes
    overwritten in the header, an offset or dimension nudged, or the header JSON mutated."""
    header, body = split_header(raw)
    kind = data.draw(st.sampled_from(["truncate", "length", "bytes", "nudge", "json"]))
    if kind == "truncate":
        return raw[:data.draw(st.integers(0, len(raw) - 1))]
    if kind == "length":
        return pack(header, body, data.draw(LENGTHS))
    if kind == "bytes":
        text = bytearray(raw[8:len(raw) - len(body)])
        for _ in range(data.draw(st.integers(1, 4))):
            text[data.draw(st.integers(0, len(text) - 1))] = data.draw(st.integers(0, 255))
        return pack(bytes(text), body)
    if kind == "nudge":
        entry = header[data.draw(st.sampled_from(by_offset(header)))]
        field = data.draw(st.sampled_from(["data_offsets", "shape"]))
        if entry[field]:
            i = data.draw(st.integers(0, len(entry[field]) - 1))
            entry[field][i] += data.draw(st.integers(-3, 3) | st.sampled_from([2**32, 2**63, -2**63]))
        return pack(header, body)
    keys = ["dtype", "shape", "data_offsets", "__metadata__"] + by_offset(header)[:4]
    values = fuzz.json_values(keys, HEADER_WORDS, ints=(-2**64, 2**64))
    return pack(fuzz.draw_mutated(data, [header], keys, values, max_depth=3), body)


def draw_index_corruption(data, index: dict, names: list[str]) -> dict:
    keys = ["metadata", "weight_map", "total_size"] + names[:4]
    words = list(SHARDS) + [f"../outside/{SHARDS[1]}", "/tmp/x.safetensors", "model.safetensors", "x.bin"]
    return fuzz.draw_mutated(data, [index], keys, fuzz.json_values(keys, words), max_depth=3)


def returns_or_refuses(fn, path: Path, what: str) -> None:
    """``fn(path)`` returns or raises a QCompileError with a fix; anything else fails the example."""
    try:
        fn(str(path))
        event(f"{what}: passed")
    except QCompileError as e:
        assert "Fix:" in str(e), e
        event(f"{what}: {e.what[:30]}")


def check_refused_or_loads(path: Path, untouched: bool) -> None:
    """The invariant: file validation ends within 5 s, its Python allocations within 16 MB; qcompile.load
    of a changed checkpoint ends within 60 s; both return or raise a QCompileError."""
    with fuzz.bounded(seconds=5, max_bytes=16 << 20):
        returns_or_refuses(read_checkpoint_dir, path, "files")
    if not untouched:
        with fuzz.bounded(seconds=60):
            returns_or_refuses(qcompile.load, path, "load")


@settings(fuzz.FUZZ, max_examples=100)
@given(data=st.data())
def test_fuzz_corrupted_checkpoint_files(data, synth_ckpt, sharded, tmp_path_factory):
    """Corruptions of a real checkpoint's model.safetensors, of one shard or of the shard index: only
    QCompileError escapes, nothing hangs, nothing allocates what a header claims."""
    src = synth_ckpt("modelopt-fp8")
    path = tmp_path_factory.mktemp("fuzz") / "ck"
    target = data.draw(st.sampled_from(["model.safetensors", SHARDS[1], INDEX]))
    shutil.copytree(sharded if target != "model.safetensors" else src, path)
    raw = (path / target).read_bytes()
    if target == INDEX:
        index = json.loads(raw)
        new = json.dumps(draw_index_corruption(data, index, sorted(index["weight_map"]))).encode()
    else:
        new = draw_corruption(data, raw)
    (path / target).write_bytes(new)
    check_refused_or_loads(path, untouched=new == raw)
    shutil.rmtree(path.parent)


# -- loads from several threads ------------------------------------------------------------------------------

def test_concurrent_loads_are_correct(synth_ckpt):
    """Two threads loading different checkpoints: every parameter is real (none left on the meta device)
    and the process's default dtype is unchanged afterwards."""
    paths = [str(synth_ckpt("modelopt-fp8")), str(synth_ckpt("ct-fp8-dynamic"))] * 2
    before = torch.get_default_dtype()
    models, errors = {}, []

    def load(i, path):
        try:
            models[i] = qcompile.load(path)
        except Exception as e:  # reported below, with its thread
            errors.append((i, e))

    threads = [threading.Thread(target=load, args=(i, p)) for i, p in enumerate(paths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = torch.get_default_dtype()
    torch.set_default_dtype(before)  # keep the other tests' process sane when this fails
    assert not errors, errors
    assert after == before
    for i, model in models.items():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            assert p.device.type == "cpu", (paths[i], name, p.device)
        assert model.lm_head.weight.device.type == "cpu"
