"""The hypothesis fuzzing shared by the quantization-config parser tests and the checkpoint-file tests:
JSON-like values built from a format's own keys and words, mutations of seed configs, the one invariant
(``exercise``): parse, describe and resolve either succeed or raise a QCompileError with a message,
nothing else, and ``bounded``: an example that hangs or allocates much fails instead."""

from __future__ import annotations

import contextlib
import signal
import tracemalloc

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from qcompile.errors import QCompileError

FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def json_scalars(words, *, ints=(-300, 300), text_size=6):
    """None, bools, ints in ``ints``, floats (NaN and inf included), one of ``words``, or short text."""
    return (st.none() | st.booleans() | st.integers(*ints) | st.floats() | st.sampled_from(words)
            | st.text(max_size=text_size))


def json_values(keys, words, *, ints=(-300, 300), text_size=6, key_size=6, dict_size=5, max_leaves=20):
    """Nested lists / dicts of ``json_scalars``; dict keys are one of ``keys`` or short text."""
    return st.recursive(json_scalars(words, ints=ints, text_size=text_size),
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                            st.sampled_from(keys) | st.text(max_size=key_size), inner, max_size=dict_size),
                        max_leaves=max_leaves)


def config_dicts(keys, values, *, key_size=8, max_size=6):
    """A top-level config: a dict of ``keys`` (or short text) to ``values``."""
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=key_size), values, max_size=max_size)


def mutate(data, value, keys, values, max_depth=5, depth=0):
    """Replace, delete or add one key somewhere in ``value`` (a copy), no deeper than ``max_depth``;
    added keys come from ``keys``, new values from the strategy ``values``."""
    if isinstance(value, dict) and value and depth < max_depth and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(value)))
        return {**value, key: mutate(data, value[key], keys, values, max_depth, depth + 1)}
    if isinstance(value, list) and value and depth < max_depth and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(value) - 1))
        return value[:i] + [mutate(data, value[i], keys, values, max_depth, depth + 1)] + value[i + 1:]
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "delete" and isinstance(value, dict) and value:
        key = data.draw(st.sampled_from(sorted(value)))
        return {k: v for k, v in value.items() if k != key}
    if action == "add" and isinstance(value, dict):
        return {**value, data.draw(st.sampled_from(keys)): data.draw(values)}
    return data.draw(values)


def draw_mutated(data, seeds, keys, values, max_depth=5):
    """One of ``seeds`` with one to three ``mutate`` steps applied."""
    config = data.draw(st.sampled_from(seeds))
    for _ in range(data.draw(st.integers(1, 3))):
        config = mutate(data, config, keys, values, max_depth)
    return config


def exercise(parse, config, probes, moe_probe=None, errors=QCompileError):
    """``parse(config)``, describe it, resolve each of ``probes`` (and ``moe_probe`` as kind "moe"): each
    step returns or raises one of ``errors`` with a message; nothing else may escape."""
    try:
        cfg = parse(config)
    except errors as e:
        assert str(e)
        return
    cfg.describe()
    for name, kind in [(p, "linear") for p in probes] + ([(moe_probe, "moe")] if moe_probe else []):
        try:
            cfg.resolve(name, kind)
        except errors as e:
            assert str(e)


class Hang(Exception):
    """An example ran past its time limit (deliberately not a QCompileError)."""


@contextlib.contextmanager
def bounded(seconds: float = 5.0, max_bytes: int | None = None):
    """Run the block with a wall-clock limit (SIGALRM: main thread only; ``re`` and Python code see it)
    and, with ``max_bytes``, fail when its Python allocations peak above that (tracemalloc)."""
    def expire(signum, frame):
        raise Hang(f"the example ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    if max_bytes is not None:
        tracemalloc.start()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if max_bytes is not None:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak <= max_bytes, f"the example allocated {peak} bytes (limit {max_bytes})"
