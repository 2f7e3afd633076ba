"""Kept for old imports: ``apexw_hf.optim.engine`` is now :mod:`apexw_hf.engines.triton.engine`.

Importing this name gives that module itself (not a copy), so attributes read or patched through the old name are
the ones the engine uses. New code imports ``apexw_hf.engines.triton.engine``.
"""

import sys

from ..engines.triton import engine as _new

sys.modules[__name__] = _new
