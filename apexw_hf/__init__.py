"""apexw_hf: fast, memory-compact AdamW optimizers for PyTorch, with Hugging Face / TRL / Unsloth integration."""

from .optim import ApexW, ApexW4bit, ApexW8bit, ApexWCompact

__version__ = "0.1.0"

__all__ = ["ApexW", "ApexW8bit", "ApexW4bit", "ApexWCompact", "__version__"]

from .accounting import optimizer_state_bytes, optimizer_state_placement  # noqa: E402
from .integrations import register as _register_integrations  # noqa: E402

__all__ += ["optimizer_state_bytes", "optimizer_state_placement"]

# optim="apexw_8bit"/"apexw_4bit"/"apexw_compact" for transformers: patches transformers when (and if) it is
# imported; imports nothing but the standard library here, so the optimizers keep working with torch alone.
_register_integrations()
