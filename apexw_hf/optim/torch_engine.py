"""Kept for old imports: ``apexw_hf.optim.torch_engine`` is now :mod:`apexw_hf.engines.torch`.

Importing this name gives that module itself (not a copy), so attributes read or patched through the old name are
the ones the engine uses. New code imports ``apexw_hf.engines.torch``.
"""

import sys

from ..engines import torch as _new

sys.modules[__name__] = _new
