"""Kept for old imports: ``apexw_hf.optim.numba_engine`` is now :mod:`apexw_hf.engines.numba`.

Importing this name gives that module itself (not a copy), so attributes read or patched through the old name are
the ones the engine uses. New code imports ``apexw_hf.engines.numba``.
"""

import sys

from ..engines import numba as _new

sys.modules[__name__] = _new
