"""What every benchmark script imports first: the repository root first on ``sys.path``.

A benchmark runs as ``python benchmarks/<name>.py`` from the repository root (as the docs and the Makefile run
it), so its own folder is on ``sys.path`` and ``from _common import ROOT`` finds this module; importing it puts
the repository root first on ``sys.path``, once, so that the script's further imports are this checkout's: the
package, the test helpers (``tests.support``: the memory meter, the dense reference, the tiny models) and the
other benchmarks (``benchmarks.<name>``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path[0] != str(ROOT):
    sys.path.insert(0, str(ROOT))
