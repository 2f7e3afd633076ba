"""The counter-based random streams of ApexW, defined once: constants and the host-side key derivation.

Every random bit ApexW uses is ``mix32(element_index * GOLDEN + key)`` (``mix32``: murmur3's 32-bit finalizer), with
one 32-bit ``key`` per (seed, tensor index, step, stream)::

    tensor_key = mix32(seed + GOLDEN * (tensor_index + 1))
    key        = mix32(mix32(tensor_key ^ mix32(step)) + stream * STREAM_MUL)

``reference.py`` expands this per element in PyTorch, the Triton kernels on the device
(``engines/triton/kernels/_rounding.py`` takes its constants from here), and the plain-PyTorch engine per chunk. This
module imports nothing, so it sits below every layer (the kernels may import it).
"""

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
MIX1 = 0x85EBCA6B
MIX2 = 0xC2B2AE35
STREAM_MUL = 0x632BE5AB
STREAM_MV, STREAM_P = 1, 3  # one stream for both moments; 2 (a separate v stream) is retired


def mix32(x: int) -> int:
    """murmur3's 32-bit finalizer on a Python int (a bijection of [0, 2**32))."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX1) & MASK32
    x ^= x >> 13
    x = (x * MIX2) & MASK32
    x ^= x >> 16
    return x


def tensor_key(seed: int, tensor_index: int) -> int:
    """The first stage of :func:`stream_key`: fixed per tensor (the kernels finish it on the device)."""
    return mix32(seed + GOLDEN * (tensor_index + 1))


def stream_key_from(tkey: int, mixed_step: int, stream: int) -> int:
    """:func:`stream_key` from ``tkey = tensor_key(...)`` and ``mixed_step = mix32(step)``."""
    return mix32(mix32(tkey ^ mixed_step) + stream * STREAM_MUL)


def stream_key(seed: int, tensor_index: int, step: int, stream: int) -> int:
    """The 32-bit key of one random stream: one tensor, one step, one use (the moments or the parameter)."""
    return stream_key_from(tensor_key(seed, tensor_index), mix32(step), stream)


def to_int32(u: int) -> int:
    """The int32 with the bits of the uint32 ``u`` (how int32 tensors and kernel arguments carry keys)."""
    u &= MASK32
    return u - (1 << 32) if u >= 1 << 31 else u
