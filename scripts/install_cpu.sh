#!/usr/bin/env bash
# Install megatron_overlap and its dependencies on a CPU-only machine (Python >= 3.10).
#
# torch is pinned to the CPU build first: an unpinned torch pulls a multi-GB CUDA build.
# megatron-core 0.19.2 declares Requires-Python >= 3.12; megatron.core itself works on 3.11,
# so it is installed with --ignore-requires-python (from PyPI: its cp312 wheel on 3.12, its
# sdist elsewhere; its runtime deps are torch, numpy, packaging, all installed here).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The CPU wheel index first (PyPI's torch is the CUDA build); the plain pin where that index
# cannot be reached (or a local wheel cache already has torch-2.13.0+cpu).
"$PY" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
  || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q packaging numpy
"$PY" -m pip install -q --ignore-requires-python --no-deps "megatron-core==0.19.2"
"$PY" -m pip install -q -e ".[test,bench]"
