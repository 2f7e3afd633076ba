"""Fine-tune one LoRA adapter from a recipe config (Unsloth on a GPU when installed, else transformers + PEFT).

    python examples/finetune_lora.py                                  # the offline default, on any machine
    python examples/finetune_lora.py configs/llama32_3b_t4.yaml --optim apexw_8bit --lr 2e-4
    python examples/finetune_lora.py offline_default --set train.max_steps=30 --output-dir /tmp/lora

It prints the training/validation loss, steps/s and optimizer-state size, and writes result.json in the output
directory. For the whole optimizer x learning-rate x seed grid use `apexw-compare` instead.
"""

import sys

from apexw_hf.recipe.finetune import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and not argv[0].startswith("-"):  # a config path as the first argument
        argv = ["--config", argv[0], *argv[1:]]
    sys.exit(main(argv))
