"""Kept for old imports: ``apexw_hf.kernels`` is now :mod:`apexw_hf.engines.triton.kernels`.

Importing this name gives that module itself (not a copy), so attributes read or patched through the old name are
the ones the engine uses. New code imports ``apexw_hf.engines.triton.kernels``.
"""

import sys

from .engines.triton import kernels as _new
from .engines.triton.kernels import _quant, _rounding, adamw, launch

# the old submodule paths (apexw_hf.kernels.launch, ...) too, so that none of them is loaded a second time
for _sub in (_quant, _rounding, adamw, launch):
    sys.modules[f"{__name__}.{_sub.__name__.rpartition('.')[2]}"] = _sub
sys.modules[__name__] = _new
