from .base import ApexW
from .compact import ApexWCompact
from .eight_bit import ApexW8bit
from .four_bit import ApexW4bit

__all__ = ["ApexW", "ApexWCompact", "ApexW8bit", "ApexW4bit"]
