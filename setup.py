"""Build hook: cffi compiles native/ into ``stella._native`` (client) and
``stella_ps._kernel`` (server), out-of-line API mode (native/build_cffi.py)."""
from setuptools import setup

setup(cffi_modules=["native/build_cffi.py:client_ffi", "native/build_cffi.py:server_ffi"])
