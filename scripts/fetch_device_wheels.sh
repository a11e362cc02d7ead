#!/usr/bin/env bash
# Dev-machine step (needs internet, no GPU): (re)download into .whl/ the wheels that the GPU
# machine lacks, for its Python 3.12 x86-64 image. Idempotent: pip reuses files already there,
# and other versions of the same packages are removed (two versions of one package stop the
# install on the device). Then pass carry=[".whl"] to every GPU run and start its command with
# `source scripts/device_setup.sh && ...` (see docs/gpu.md).
#
#   megatron-core 0.19.2  the only package missing on the GPU image (Requires-Dist, no extras:
#                         torch>=2.6.0, numpy, packaging>=24.2 -- all on the image)
#   packaging 26.4        carried only as a fallback: device_setup.sh installs it only if the
#                         image's packaging is missing or older than megatron-core requires
#   pybind11 3.0.1        headers + build helpers for the C++ resource solver, which
#                         device_setup.sh compiles in place (py3-none-any)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
MEGATRON_CORE_VERSION=0.19.2
PACKAGING_VERSION=26.4
PYBIND11_VERSION=3.0.1
mkdir -p .whl
# keep one version of each package
find .whl -maxdepth 1 -name 'megatron_core-*.whl' ! -name "megatron_core-${MEGATRON_CORE_VERSION}-*" -print -delete
find .whl -maxdepth 1 -name 'packaging-*.whl' ! -name "packaging-${PACKAGING_VERSION}-*" -print -delete
find .whl -maxdepth 1 -name 'pybind11-*.whl' ! -name "pybind11-${PYBIND11_VERSION}-*" -print -delete
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "megatron-core==${MEGATRON_CORE_VERSION}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    -d .whl "packaging==${PACKAGING_VERSION}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    -d .whl "pybind11==${PYBIND11_VERSION}"
ls -l .whl/*.whl
echo "ok: .whl is ready; pass carry=[\".whl\"] to each GPU run (total $(du -sh .whl | cut -f1))"
