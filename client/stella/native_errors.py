"""The one checked-call boundary to Stella's C code, shared by every wrapper.

Two cffi modules hold the C: ``stella._native`` (client: wire coding, top-k
selection; wrapped by ``stella._codec_native`` and ``stella._select_native``) and
``stella_ps._kernel`` (server: the lazy optimizer, wrapped by ``stella_ps.kernel``, and
the broadcast's selection, by ``stella_ps.topk``, and the flat residual's index, by
``stella_ps.residual``); :mod:`stella.native_select` wraps the
selection for either.
Each wrapper calls :func:`require_abi` once at import and :func:`check` after every
call that returns a code, as PyNaCl's ``ensure`` and pyzmq's ``_check_rc`` do. The
return codes (``lib.STELLA_E_*``) and their text (``stella_strerror``) come from
``native/stella_native.h`` through cffi: nothing here mirrors a C table.

Both modules take sparse changes as arrays of ``stella_sparse_list`` (indices, values,
count): :func:`sparse_lists` builds one.

Both modules also choose, once, the x86-64 level their hot kernels run at
(``native/stella_isa.h``): :func:`isa_info` reads the choice, :func:`warn_isa_fallback`
says when ``STELLA_NATIVE_ISA`` asked for a level this CPU lacks.

The server imports this public module; it never imports private ``stella._*`` ones.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cffi import FFI

__all__ = ["ABI_VERSION", "require_abi", "strerror", "check", "ISA_ENV", "NativeIsa", "isa_info",
           "warn_isa_fallback", "sparse_lists"]

ABI_VERSION = 13
"""The ``STELLA_ABI_VERSION`` these wrappers were written against (native/stella_native.h);
bumped together with it."""

_ffi = FFI()  # only to read C strings; the wrappers own their modules' ffi

ExcSpec = type[BaseException] | Mapping[Any, type[BaseException]]


def require_abi(lib: Any, module_name: str) -> None:
    """Fail the import when ``lib`` was built from other headers than these wrappers
    expect (a stale build after a pull): rebuild with ``make install``."""
    built = lib.STELLA_ABI_VERSION
    running = lib.stella_abi_version()
    if not built == running == ABI_VERSION:
        raise ImportError(
            f"{module_name}: native ABI {running} (headers {built}), wrappers expect {ABI_VERSION}; "
            "rebuild with `make install`"
        )


def strerror(lib: Any, rc: int) -> str:
    """The C library's text for return code ``rc``."""
    return _ffi.string(lib.stella_strerror(int(rc))).decode()


def check(lib: Any, rc: int, what: str, exc: ExcSpec) -> int:
    """Return ``rc`` when it is not an error code (>= 0); else raise.

    ``exc`` is the exception class for every error code, or a mapping from codes
    (``lib.STELLA_E_*``) to classes with ``None`` as the default. ``STELLA_E_NOMEM``
    raises :class:`MemoryError` unless the mapping names it. The message is
    ``"{what}: {stella_strerror(rc)} (code {rc})"``.
    """
    rc = int(rc)
    if rc >= 0:
        return rc
    if isinstance(exc, Mapping):
        cls = exc.get(rc) or (MemoryError if rc == lib.STELLA_E_NOMEM else exc[None])
    else:
        cls = MemoryError if rc == lib.STELLA_E_NOMEM else exc
    raise cls(f"{what}: {strerror(lib, rc)} (code {rc})")


ISA_ENV = "STELLA_NATIVE_ISA"
"""Environment override of the kernels' x86-64 level: ``auto`` (default), ``portable``,
``x86-64-v3`` or ``x86-64-v4``; read once per module, at its first native call."""

ISA_LEVELS = ("portable", "x86-64-v3", "x86-64-v4")
"""The levels, in the order of their bits (``STELLA_ISA_*``, native/stella_isa.h)."""


def sparse_lists(ffi: FFI, lists: Sequence[tuple[Any, Any]]) -> tuple[Any, list[Any]]:
    """``lists`` (pairs of 1-D contiguous int32 indices and float32 values of one length,
    checked by the caller) as a C ``stella_sparse_list[]`` of ``ffi``, and the buffers it
    points into (keep them alive through the call)."""
    out = ffi.new("stella_sparse_list[]", len(lists))
    keep = []
    for lst, (idx, val) in zip(out, lists):
        keep += [ffi.from_buffer("int32_t[]", idx), ffi.from_buffer("float[]", val)]
        lst.idx, lst.val, lst.n = keep[-2], keep[-1], idx.shape[0]
    return out, keep


@dataclass(frozen=True)
class NativeIsa:
    """The x86-64 level a native module's dispatched kernels run at."""

    level: str
    """The chosen level: one of :data:`ISA_LEVELS`."""
    requested: str
    """What ``STELLA_NATIVE_ISA`` asked for: ``auto``, a level, or ``unknown``."""
    compiled: tuple[str, ...]
    """The levels the module holds (only ``portable`` off x86-64 or without GCC)."""
    runnable: tuple[str, ...]
    """The compiled levels this CPU runs."""

    @property
    def fell_back(self) -> bool:
        """True when the level asked for was not taken (the CPU lacks it, or the name is unknown)."""
        return self.requested != "auto" and self.requested != self.level


def isa_info(lib: Any) -> NativeIsa:
    """The ISA level of ``lib`` (``stella._native`` or ``stella_ps._kernel``); the first
    call of a process chooses it."""
    def levels(mask: int) -> tuple[str, ...]:
        return tuple(name for bit, name in enumerate(ISA_LEVELS) if mask >> bit & 1)

    return NativeIsa(
        level=_ffi.string(lib.stella_native_isa()).decode(),
        requested=_ffi.string(lib.stella_native_isa_requested()).decode(),
        compiled=levels(lib.stella_native_isa_levels(0)),
        runnable=levels(lib.stella_native_isa_levels(1)),
    )


def warn_isa_fallback(lib: Any, module_name: str) -> NativeIsa:
    """:func:`isa_info`, with a :class:`RuntimeWarning` when ``STELLA_NATIVE_ISA`` asked
    for a level that was not taken."""
    info = isa_info(lib)
    if info.fell_back:
        asked = os.environ.get(ISA_ENV, "") if info.requested == "unknown" else info.requested
        warnings.warn(
            f"{module_name}: {ISA_ENV}={asked!r} is not a level this CPU runs "
            f"(runnable: {', '.join(info.runnable)}); running {info.level}",
            RuntimeWarning,
            stacklevel=2,
        )
    return info
