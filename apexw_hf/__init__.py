"""apexw_hf: fast, memory-compact AdamW optimizers for PyTorch, with Hugging Face / TRL / Unsloth integration."""

from .optim import ApexW, ApexW8bit, ApexWCompact

__version__ = "0.1.0"

__all__ = ["ApexW", "ApexW8bit", "ApexWCompact", "__version__"]
