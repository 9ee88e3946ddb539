"""``python -m benchmarks``: the whole benchmark suite, or some of its workloads (see
``suite.py``)."""

import sys

from benchmarks.suite import main

sys.exit(main())
