from .base import ApexW
from .compact import ApexWCompact
from .eight_bit import ApexW8bit

__all__ = ["ApexW", "ApexWCompact", "ApexW8bit"]
