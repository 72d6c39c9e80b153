"""Makes ``TORCH_LOGS="qcompile"`` valid.

torch checks TORCH_LOGS while it is being imported, before any package can register a log of its
own, and rejects names it does not know. ``qcompile_torch_logs.pth`` runs this at interpreter start;
it does nothing unless TORCH_LOGS mentions qcompile, and then registers the "qcompile" log the moment
``torch._logging._internal`` has been executed (before torch parses the variable).
"""

import os
import sys


def _install():
    if "qcompile" not in os.environ.get("TORCH_LOGS", ""):
        return
    import importlib.abc
    import importlib.machinery

    class _RegisterQCompileLog(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "torch._logging._internal":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_register(module):
                exec_module(module)
                module.register_log("qcompile", "qcompile")

            spec.loader.exec_module = exec_and_register
            return spec

    sys.meta_path.insert(0, _RegisterQCompileLog())


_install()
