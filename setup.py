"""Build hook: cffi compiles native/ into ``stella._native`` (client) and
``stella_ps._kernel`` (server), out-of-line API mode (native/build_cffi.py).

A wheel (``python -m build``, ``pip wheel``, ``pip install .``) may run on another
machine, so unless ``STELLA_NATIVE_ARCH`` says otherwise its portable copy of the kernels
is built for ``x86-64-v2`` (the compiler's default target off x86-64), the SIMD paths
coming from the run-time dispatch; an editable install (``make install``) is built where
it runs, at build_cffi.py's default ``-march=native``. The flags are fixed when
``cffi_modules`` is read, before any command runs, hence the look at the command line.
"""
import os
import platform
import sys

from setuptools import setup

if "bdist_wheel" in sys.argv and "STELLA_NATIVE_ARCH" not in os.environ:
    os.environ["STELLA_NATIVE_ARCH"] = "x86-64-v2" if platform.machine().lower() in ("x86_64", "amd64") else ""

setup(cffi_modules=["native/build_cffi.py:client_ffi", "native/build_cffi.py:server_ffi"])
