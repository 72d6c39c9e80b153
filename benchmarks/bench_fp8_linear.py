"""FP8 linear benchmark (CUDA). The code lives in qcompile/bench.py so that `qcompile bench` ships it."""

import sys

from qcompile.bench import main

if __name__ == "__main__":
    sys.exit(main())
