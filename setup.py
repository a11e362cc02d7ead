"""Build of the C++ resource solver (`megatron_overlap.resource._solver`).

Everything else about the package is in pyproject.toml. `pip install -e .` (and a plain
`pip install .`) compile csrc/solver.cpp with pybind11; on a machine without pip access to
an index (the GPU machine) `python setup.py build_ext --inplace` builds it next to the
sources (scripts/device_setup.sh does that). The package still imports without it: the
resource manager then runs the Python twin and warns once.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "megatron_overlap.resource._solver",
        ["csrc/solver.cpp"],
        cxx_std=17,
        # -ffp-contract=off: no fused multiply-add, so the few double operations round
        # exactly as the Python twin's do.
        extra_compile_args=["-O3", "-ffp-contract=off"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
