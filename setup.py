"""The compiled core (zbus/_core.c) is optional: where it cannot be built, zbus runs
the same steps in Python (zbus.ring chooses at import)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("zbus._core", ["zbus/_core.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
