"""qcompile's own error types.

Every problem with user input (a quantization config, a checkpoint, an option, the machine) is raised
as a subclass of :class:`QCompileError` whose message names *where* (layer / tensor / config key),
*what* is wrong and *how to fix it*. Tests assert on this type: no other exception type may escape a
parser or the loader for bad input.
"""

from __future__ import annotations


class QCompileError(ValueError):
    """Base class. Subclasses ValueError so callers that catch ValueError keep working."""

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        msg = f"{where}: {what}" if where else what
        if fix:
            msg += f" Fix: {fix}"
        super().__init__(msg)


class ConfigError(QCompileError):
    """A quantization config (hf_quant_config.json / config.json quantization_config / options) is
    malformed or names something unknown."""


class CheckpointError(QCompileError):
    """A checkpoint tensor is missing, mis-shaped, of the wrong dtype, or holds NaN / inf / zero scales."""


class UnsupportedError(QCompileError):
    """The input is well-formed but qcompile cannot run it (yet, or on this machine)."""
