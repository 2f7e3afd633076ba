"""Kept for old imports: ``apexw_hf.optim.torch_passes`` is now :mod:`apexw_hf.engines.torch_passes`.

Importing this name gives that module itself (not a copy), so attributes read or patched through the old name are
the ones the engine uses. New code imports ``apexw_hf.engines.torch_passes``.
"""

import sys

from ..engines import torch_passes as _new

sys.modules[__name__] = _new
