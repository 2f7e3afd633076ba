"""Engine tests run the Triton engine on the GPU when there is one, else on the CPU under the Triton interpreter.

As in ``tests/kernels/conftest.py``: ``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates the kernels, so it is
set here, before any test module of this directory imports ``apexw_hf.engines.triton.kernels``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
