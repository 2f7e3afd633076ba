"""The LoRA fine-tuning recipe and the optimizer comparison runner.

* :mod:`.config`: one YAML file per set-up (model, LoRA, data, trainer arguments, comparison grid) in dataclasses.
* :mod:`.data`: FineTome-100k / alpaca-cleaned through `datasets` when online, the shipped set offline.
* :mod:`.finetune`: one fine-tune (Unsloth on a GPU when installed, else transformers + PEFT) -> a result JSON.
* :mod:`.compare`: ``apexw-compare``, the optimizers x learning rates x seeds grid, one process per run.
* :mod:`.report`: CSV, the markdown table with mean +- std and Welch's t-test, loss curves.

Nothing here is imported by ``import apexw_hf``; the modules import transformers and friends only when used.
"""

__all__ = ["config", "data", "finetune", "compare", "report"]
