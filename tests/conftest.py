"""Shared fixtures: the producers' tiny checkpoints (tests/data/checkpoints) and synthesized ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parent / "data"
# the producers' checkpoints shipped with the tests; QCOMPILE_TESTDATA points at another folder of them
TESTDATA = Path(os.environ.get("QCOMPILE_TESTDATA", DATA / "checkpoints"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def testdata() -> Path:
    """The folder of the producers' tiny checkpoints (tests/data/README.md lists them)."""
    if not TESTDATA.is_dir():
        raise FileNotFoundError(f"producer checkpoints not found at {TESTDATA}: point QCOMPILE_TESTDATA at a folder "
                                "of them, or unset it to use tests/data/checkpoints")
    return TESTDATA


@pytest.fixture(scope="session")
def synth_ckpt(tmp_path_factory):
    """synth_ckpt("modelopt-fp8") -> path of a tiny checkpoint in that format (written once per session)."""
    from qcompile import synth

    cache: dict[str, Path] = {}

    def make(fmt: str) -> Path:
        if fmt not in cache:
            cache[fmt] = Path(synth.write_checkpoint(str(tmp_path_factory.mktemp(fmt)), fmt))
        return cache[fmt]

    return make


@pytest.fixture(scope="session")
def one_layer(tmp_path_factory):
    """one_layer("ct-w4a16") -> path of a one-layer tiny checkpoint in that format (written once per session)."""
    from qcompile import synth

    cache: dict[str, Path] = {}

    def make(fmt: str) -> Path:
        if fmt not in cache:
            path = tmp_path_factory.mktemp(f"one-layer-{fmt}")
            synth.write_checkpoint(str(path), fmt, config=synth.tiny_llama_config(num_hidden_layers=1))
            cache[fmt] = path
        return cache[fmt]

    return make


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for the module's tests: tiny models run as fast on one, and several threads
    slow each other down on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
