"""The one checked-call boundary to Stella's C code, shared by every wrapper.

Two cffi modules hold the C: ``stella._native`` (client: wire coding, top-k
selection; wrapped by ``stella._codec_native`` and ``stella._select_native``) and
``stella_ps._kernel`` (server: the lazy optimizer; wrapped by ``stella_ps.kernel``).
Each wrapper calls :func:`require_abi` once at import and :func:`check` after every
call that returns a code, as PyNaCl's ``ensure`` and pyzmq's ``_check_rc`` do. The
return codes (``lib.STELLA_E_*``) and their text (``stella_strerror``) come from
``native/stella_native.h`` through cffi: nothing here mirrors a C table.

The server imports this public module; it never imports private ``stella._*`` ones.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cffi import FFI

__all__ = ["ABI_VERSION", "require_abi", "strerror", "check"]

ABI_VERSION = 3
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
