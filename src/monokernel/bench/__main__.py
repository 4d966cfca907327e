"""``python -m monokernel.bench ...`` == ``monokernel bench ...``."""

import sys

from monokernel.bench.cli import main

sys.exit(main(sys.argv[1:]))
