"""Only here to ship qcompile_torch_logs.pth into site-packages (see _qcompile_torch_logs.py);
everything else is in pyproject.toml."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "qcompile_torch_logs.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth}, py_modules=["_qcompile_torch_logs"])
