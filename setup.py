"""Build of the C++ extensions: the resource solver (`megatron_overlap.resource._solver`) and
the GatherRS host layout (`megatron_overlap.ops._layout`).

Everything else about the package is in pyproject.toml. `pip install -e .` (and a plain
`pip install .`) compile csrc/solver.cpp and csrc/layout.cpp with pybind11; on a machine
without pip access to an index (the GPU machine) `python setup.py build_ext --inplace` builds
them next to the sources (scripts/device_setup.sh does that). The package still imports
without them: the resource manager then runs the Python twin and warns once, and
`direct_layout` runs its numpy twin.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

# -ffp-contract=off: no fused multiply-add, so the solver's few double operations round
# exactly as the Python twin's do (the layout is integer-only; same flags for both).
_FLAGS = {"cxx_std": 17, "extra_compile_args": ["-O3", "-ffp-contract=off"]}

ext_modules = [
    Pybind11Extension("megatron_overlap.resource._solver", ["csrc/solver.cpp"], **_FLAGS),
    Pybind11Extension("megatron_overlap.ops._layout", ["csrc/layout.cpp"], **_FLAGS),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
