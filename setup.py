"""The package's compiled part; everything else is declared in pyproject.toml.

The tree's loops are C++ (the route's search, training's sampling from p_n and step of its node term;
service/engine/_tree_native.cpp says why). It builds with the compiler hnswlib's source build
already needs, and reads numpy arrays as plain buffers (no numpy headers at build time).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "service.engine._tree_native",
            sources=["service/engine/_tree_native.cpp"],
            language="c++",
            extra_compile_args=["-O2", "-std=c++17"],
        )
    ]
)
