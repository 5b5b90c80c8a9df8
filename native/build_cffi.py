"""cffi builds of Stella's native code (out-of-line API mode): one module per owner.

``stella._native`` (client)       codec.c, half.c, quant.c (wire coding), compress.c (top-k selection),
                                  flat.c (the model's parameters read and written as one flat vector)
``stella_ps._kernel`` (server)    optim_state.c, merge.c, update.c, union.c (lazy optimizer),
                                  compress.c (the broadcast's streaming selection: the workers'
                                  top-k, compiled here too so that a step's selection stays in the
                                  server's module), residual.c (the flat residual and the index
                                  of its largest magnitudes: a light step's top-k without a pass
                                  over the model)

Both also compile core.c (ABI version, ``stella_strerror``, the sortedness check)
and share ``stella_native.h`` (return codes, value dtypes, bit casts) and
``stella_half.h`` (the one f16/bf16 converter). ``cdefs/<area>.h`` is the cffi
declaration of one area: the functions of that area's sources and its constants
(``cdefs/core.h`` declares the shared constants as ``...``, filled from
``stella_native.h`` at build time). ``setup.py`` lists :data:`client_ffi` and
:data:`server_ffi`; ``bench/_native_bench.py`` builds a third, bench-only module with
:func:`builder` (the kernel compiled with ``-DSTELLA_TUNABLE`` plus ``native/bench/``).

``STELLA_NATIVE_ARCH`` picks ``-march`` (default ``native``: the package is built
where it runs, as an editable install is; a portable level such as ``x86-64-v2``, what
wheels and images use, builds for other machines: ``setup.py`` makes it a wheel's
default; empty: no ``-march``, the compiler's default target). ``STELLA_NATIVE_DEBUG=1``
builds with ``-O0 -g``.

Run-time dispatch (``stella_isa.h``): the sources with SIMD paths (compress.c,
flat.c, half.c, quant.c, merge.c, update.c) are also compiled through ``isa/<source>_v3.c`` and
``_v4.c``, which set ``#pragma GCC target("arch=x86-64-v3")`` (v4) and include the
source, so one module holds a portable copy (at ``-march``), an AVX2/F16C copy and an
AVX-512 copy of their entry points, and picks one at run time from the CPU (override:
``STELLA_NATIVE_ISA=auto|portable|x86-64-v3|x86-64-v4``; ``stella_native_isa()``
names the choice). Off x86-64, or with a compiler other than GCC 11+, the wrappers
compile to nothing and the portable copy is the only one.
"""
from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# Sources whose entry points are dispatched by ISA level (stella_isa.h): each is also
# compiled as isa/<name>_v3.c and isa/<name>_v4.c (empty where dispatch is off).
ISA_LEVELS = ("v3", "v4")


def _with_variants(*sources: str) -> list[str]:
    return [*sources, *(f"isa/{s[:-2]}_{lv}.c" for s in sources for lv in ISA_LEVELS)]


# area -> (C header the generated module includes, sources); the cdef is cdefs/<area>.h
AREAS = {
    "core": ("stella_native.h", ["core.c"]),
    "codec": ("cdefs/codec.h", ["codec.c", *_with_variants("half.c", "quant.c")]),
    "compress": ("cdefs/compress.h", _with_variants("compress.c")),
    "flat": ("cdefs/flat.h", _with_variants("flat.c")),
    "optim": ("cdefs/optim.h", ["optim_state.c", "union.c", *_with_variants("merge.c", "update.c")]),
    "residual": ("cdefs/residual.h", ["residual.c"]),
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


client_ffi = builder("stella._native", ["codec", "compress", "flat"])
server_ffi = builder("stella_ps._kernel", ["optim", "compress", "residual"])
