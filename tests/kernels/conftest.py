"""Kernel tests run on the GPU when there is one, else on the CPU under the Triton interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates the kernels, so it is set here, before any test module
imports ``apexw_hf.engines.triton.kernels``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
