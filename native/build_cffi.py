"""cffi build script for ``stella._native`` (out-of-line API mode).

Every ``native/cdefs/*.h`` holds the plain C declarations of one source file's
public functions; they are concatenated into the cdef and into the generated
module's prelude, and every ``native/*.c`` is compiled in. A new kernel therefore
adds one ``.c`` and one ``cdefs/*.h`` and touches nothing else.

``STELLA_NATIVE_ARCH`` picks ``-march`` (default ``native``: the package is built
where it runs; Docker images set a portable level such as ``x86-64-v3``).
``STELLA_NATIVE_DEBUG=1`` builds with ``-O0 -g`` and bounds assertions.
"""
from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
# setuptools wants source paths relative to the project root.
ROOT = HERE.parent


def _rel(p: pathlib.Path) -> str:
    return os.path.relpath(p, ROOT) if p.is_relative_to(ROOT) else str(p)


CDEFS = "\n".join(p.read_text() for p in sorted((HERE / "cdefs").glob("*.h")))
SOURCES = [_rel(p) for p in sorted(HERE.glob("*.c"))]

arch = os.environ.get("STELLA_NATIVE_ARCH", "native")
if os.environ.get("STELLA_NATIVE_DEBUG") == "1":
    cflags = ["-O0", "-g", "-DSTELLA_DEBUG=1"]
else:
    cflags = ["-O3", "-fno-math-errno", "-funroll-loops"]
if arch:
    cflags.append(f"-march={arch}")
cflags += ["-std=c11", "-pthread", "-Wall", "-Wno-unused-function"]

ffibuilder = FFI()
ffibuilder.cdef(CDEFS)
ffibuilder.set_source(
    "stella._native",
    '#include "stella_native.h"\n' + CDEFS,
    sources=SOURCES,
    include_dirs=[_rel(HERE)],
    extra_compile_args=cflags,
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
