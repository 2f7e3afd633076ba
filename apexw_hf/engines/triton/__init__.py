"""The Triton engine (:mod:`.engine`) and its kernels (:mod:`.kernels`).

Importing this package does not import triton: the engine imports its kernels on first use (``TRITON_INTERPRET`` is
read then, when they are decorated), so the optimizer works without triton installed.
"""

from .engine import TritonEngine

__all__ = ["TritonEngine"]
