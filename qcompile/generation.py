"""HF ``generate`` on CUDA without a host wait at every token.

transformers' decoding loop reads ``unfinished_sequences.max() == 0`` on the host after each step, which
waits for the device: the host prepares step n + 1 (inputs, masks, the compiled call's guards, logits
processing) only once step n has finished, so that host time adds to every token. transformers ships the
remedy, ``DeferredStopCheck`` (the flag copied asynchronously and read one step later; a step past an
end-of-sequence token is computed and undone, the cache cropped when it is returned), and enables it on
"mps" only. :func:`deferred_stop` enables it on CUDA for the ``generate`` calls inside it, except with assisted
decoding, a returned cache that cannot be cropped, or several processes decoding together; models loaded by
qcompile call ``generate`` inside it (``QCOMPILE_DEFER_STOP=0`` turns that off). The tokens are the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("qcompile_deferred_stop", default=False)


def _install() -> None:
    """Wrap ``DeferredStopCheck.is_supported`` once so that it also accepts CUDA inside :func:`deferred_stop`
    (nothing to do where this transformers has no deferred stop check)."""
    from transformers.generation import utils

    cls = getattr(utils, "DeferredStopCheck", None)
    if cls is None or not hasattr(cls, "is_supported") or getattr(cls.is_supported, "qcompile", False):
        return
    upstream = cls.is_supported

    def is_supported(device, cache, cache_is_returned, is_assistant):
        if _ACTIVE.get() and torch.device(device).type == "cuda" and not is_assistant and not _distributed():
            # the conditions transformers applies on mps: a returned cache must be croppable
            return cache is None or cache.is_croppable or not cache_is_returned
        return upstream(device, cache, cache_is_returned, is_assistant)

    is_supported.qcompile = True
    cls.is_supported = staticmethod(is_supported)


def _distributed() -> bool:
    """Several processes decode together (their loops may synchronize on the stop flag): left as transformers
    runs them."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def deferred_stop():
    """``generate`` calls inside defer their stop check by one step on CUDA (module docstring)."""
    _install()
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class DeferredGenerate:
    """``model.generate`` of a model qcompile loaded: the class's ``generate`` inside :func:`deferred_stop`.
    An object, not a bound method, so that the model still pickles and deep-copies."""

    def __init__(self, model):
        self.model = model
        self.__doc__ = type(model).generate.__doc__

    def __call__(self, *args, **kwargs):
        method = type(self.model).generate
        if os.environ.get("QCOMPILE_DEFER_STOP", "1") == "0":
            return method(self.model, *args, **kwargs)
        with deferred_stop():
            return method(self.model, *args, **kwargs)
