#!/usr/bin/env bash
# Installs Unsloth (and the few packages it needs beyond the `test` extra) WITHOUT its dependencies into
# ./.unsloth-site, for tests/integrations/test_unsloth.py, which runs Unsloth's CPU mode in a subprocess with that
# directory first on its path. A plain `pip install unsloth` would replace torch 2.13 (CPU) with a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
site=.unsloth-site
[ -d "$site/unsloth" ] && exit 0
python -m pip install -q --no-deps --target "$site" unsloth==2026.10.9 unsloth_zoo==2026.10.9 tyro==1.0.17 \
  docstring-parser==0.18.0 shtab==1.13.0 typeguard==4.6.1 msgspec==0.23.0 cut_cross_entropy==25.1.1 structlog==26.1.0 \
  json5==0.17.3 nest-asyncio==1.6.0 hf_transfer==0.1.9 sentencepiece==0.2.3
