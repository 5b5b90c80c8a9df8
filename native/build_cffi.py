"""cffi builds of Stella's native code (out-of-line API mode): one module per owner.

``stella._native`` (client)       codec.c (wire coding), compress.c (top-k selection)
``stella_ps._kernel`` (server)    optim_state.c, merge.c, update.c, union.c (lazy optimizer)

Both also compile core.c (ABI version, ``stella_strerror``, the sortedness check)
and share ``stella_native.h`` (return codes, value dtypes, bit casts) and
``stella_half.h`` (the one f16/bf16 converter). ``cdefs/<area>.h`` is the cffi
declaration of one area: the functions of that area's sources and its constants
(``cdefs/core.h`` declares the shared constants as ``...``, filled from
``stella_native.h`` at build time). ``setup.py`` lists :data:`client_ffi` and
:data:`server_ffi`; ``bench/_native_bench.py`` builds a third, bench-only module with
:func:`builder` (the kernel compiled with ``-DSTELLA_TUNABLE`` plus ``native/bench/``).

``STELLA_NATIVE_ARCH`` picks ``-march`` (default ``native``: the package is built
where it runs; set a portable level such as ``x86-64-v3`` to build for other
machines). ``STELLA_NATIVE_DEBUG=1`` builds with ``-O0 -g``.
"""
from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# area -> (C header the generated module includes, sources); the cdef is cdefs/<area>.h
AREAS = {
    "core": ("stella_native.h", ["core.c"]),
    "codec": ("cdefs/codec.h", ["codec.c"]),
    "compress": ("cdefs/compress.h", ["compress.c"]),
    "optim": ("cdefs/optim.h", ["optim_state.c", "merge.c", "update.c", "union.c"]),
    "bench": ("optim_tuning.h", ["bench/tuning.c", "bench/probe.c"]),
}


def _cflags() -> list[str]:
    if os.environ.get("STELLA_NATIVE_DEBUG") == "1":
        flags = ["-O0", "-g"]
    else:
        flags = ["-O3", "-fno-math-errno", "-funroll-loops"]
    arch = os.environ.get("STELLA_NATIVE_ARCH", "native")
    if arch:
        flags.append(f"-march={arch}")
    return flags + ["-std=c11", "-pthread", "-Wall", "-Wno-unused-function"]


def builder(module: str, areas: list[str], *, defines: tuple[str, ...] = (), absolute: bool = False) -> FFI:
    """An FFI for ``module`` holding core plus ``areas``. setuptools wants paths relative
    to the project root; ``absolute=True`` is for builds run from elsewhere."""
    areas = ["core", *areas]

    def path(p: pathlib.Path) -> str:
        return str(p) if absolute else os.path.relpath(p, ROOT)

    ffi = FFI()
    ffi.cdef("\n".join((HERE / "cdefs" / f"{a}.h").read_text() for a in areas))
    ffi.set_source(
        module,
        "".join(f'#include "{AREAS[a][0]}"\n' for a in areas),
        sources=[path(HERE / s) for a in areas for s in AREAS[a][1]],
        include_dirs=[path(HERE)],
        define_macros=[(d, "1") for d in defines],
        extra_compile_args=_cflags(),
        extra_link_args=["-pthread"],
    )
    return ffi


client_ffi = builder("stella._native", ["codec", "compress"])
server_ffi = builder("stella_ps._kernel", ["optim"])
