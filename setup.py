"""Build hook: cffi compiles native/ into ``stella._native`` (out-of-line API mode)."""
from setuptools import setup

setup(cffi_modules=["native/build_cffi.py:ffibuilder"])
