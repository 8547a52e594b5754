"""``python -m gpumesh_bench.gpu``: see :mod:`gpumesh_bench.gpu.cli`."""

import sys

from gpumesh_bench.gpu.cli import main

sys.exit(main())
