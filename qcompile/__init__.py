"""qcompile: run quantized HuggingFace checkpoints fast with ``torch.compile(model, backend="qcompile")``.

Public API: :func:`load`, :class:`QCompileConfig`, :func:`backend`, :func:`explain`, :func:`tune`.
Importing qcompile registers the ModelOpt format with transformers (plain ``from_pretrained`` then
loads ModelOpt checkpoints), the ``qcompile::`` custom ops and, where the installed entry point does not
already, the backend name "qcompile" with torch.compile.
"""

from .errors import CheckpointError, ConfigError, QCompileError, UnsupportedError
from .loading import QCompileConfig, load, register_with_transformers
from .kernels.wo_tune import tune
from .scheme import LayerQuant, QuantScheme

register_with_transformers()


def _register_torch_log():
    import torch._logging._internal as torch_logs

    if "qcompile" not in torch_logs.log_registry.log_alias_to_log_qnames:
        torch_logs.register_log("qcompile", "qcompile")


_register_torch_log()

from .backend import backend, explain, register_dynamo_backend  # noqa: E402
from . import kv_cache  # noqa: E402,F401  (qcompile.kv_cache.FP8Cache)

register_dynamo_backend()

__all__ = ["load", "QCompileConfig", "backend", "explain", "tune", "QCompileError", "ConfigError", "CheckpointError",
           "UnsupportedError", "LayerQuant", "QuantScheme"]
__version__ = "0.1.0"
