"""The package's one compiled part: the context pass of codec v2 (engine_ext/format/context/scan_native.c).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is found (or it fails),
setuptools warns and installs the package without it, and the pass runs in numba (scan_kernels.py), the same
positions at about a quarter of the speed.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engine_ext.format.context._scan_native",
            sources=["engine_ext/format/context/scan_native.c"],
            depends=["engine_ext/format/context/scan_native_pass.h"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
