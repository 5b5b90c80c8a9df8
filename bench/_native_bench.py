"""Bench-only build of the optimizer kernel: tunable, with the roofline probe.

Production ``stella_ps._kernel`` compiles the kernel's tuning (prefetch distance,
merge tile, prefetch kind) as constants and has no probe. This module compiles the
same kernel sources with ``-DSTELLA_TUNABLE`` plus ``native/bench/`` (the tuning
knobs, ``stella_probe_random_rmw`` and ``stella_probe_layout``) into ``build/native_bench/<hash>/`` on first
use, with the builder of ``native/build_cffi.py``, and serves ``bench/kernel.py``
and the tuning test of ``tests/test_kernel.py``. A change of any native source
gives a new hash, hence a rebuild.
"""
from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
import types
from functools import cache

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
MODULE = "_stella_kernel_bench"

__all__ = ["load", "state_class", "default_tuning", "set_tuning", "probe_random_rmw", "probe_layout"]


def _module_from(name: str, path: pathlib.Path, register: bool = False) -> types.ModuleType:
    """Module ``name`` executed from the file ``path`` (in sys.modules first when ``register``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name} from {path}")
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _build_script():
    return _module_from("_stella_build_cffi", NATIVE / "build_cffi.py")


@cache
def load():
    """(ffi, lib) of the bench build, compiled on first use."""
    h = hashlib.sha256()
    for p in sorted(NATIVE.rglob("*")):
        if p.is_file() and p.suffix in (".c", ".h", ".py"):
            h.update(p.relative_to(NATIVE).as_posix().encode() + b"\0" + p.read_bytes())
    out = ROOT / "build" / "native_bench" / h.hexdigest()[:16]
    found = sorted(out.glob(f"{MODULE}*.so")) if out.exists() else []
    if not found:
        out.mkdir(parents=True, exist_ok=True)
        ffi = _build_script().builder(MODULE, ["optim", "bench"], defines=("STELLA_TUNABLE",), absolute=True)
        found = [pathlib.Path(ffi.compile(tmpdir=str(out), verbose=False))]
    mod = _module_from(MODULE, found[0])
    sys.modules.setdefault(MODULE, mod)
    from stella.native_errors import require_abi

    require_abi(mod.lib, MODULE)
    return mod.ffi, mod.lib


@cache
def state_class():
    """:class:`stella_ps.kernel.KernelTensorState` on the bench build: the production
    wrapper's own source, loaded a second time as a module of a bench package whose
    ``_kernel`` is the tunable build (its other imports are the production modules), so
    the wrapper has no hooks for the bench and the bench runs exactly its code."""
    import types

    import stella_ps
    from stella_ps import errors, optim

    load()
    pkg = "_stella_ps_bench"
    if f"{pkg}.kernel" not in sys.modules:
        parent = types.ModuleType(pkg)
        parent.__path__ = []  # a package, with nothing to find on disk
        sys.modules[pkg] = parent
        sys.modules[f"{pkg}._kernel"] = sys.modules[MODULE]
        sys.modules[f"{pkg}.errors"], sys.modules[f"{pkg}.optim"] = errors, optim
        _module_from(f"{pkg}.kernel", pathlib.Path(stella_ps.__file__).parent / "kernel.py", register=True)
    return sys.modules[f"{pkg}.kernel"].KernelTensorState


def default_tuning() -> tuple[int, int, int]:
    """(prefetch distance, tile, mode) that production builds compile (native/optim_internal.h)."""
    _, lib = load()
    return (lib.STELLA_TUNE_PREFETCH, lib.STELLA_TUNE_TILE, lib.STELLA_TUNE_MODE)


def set_tuning(prefetch_distance: int = -1, tile: int = -1, mode: int = -1) -> None:
    """Process-wide knobs of the bench build: software prefetch distance (0 = off), merge
    tile, mode (bit 0: prefetcht1 into L2 instead of prefetchw into L1; bit 1: also
    prefetch while merging); -1 keeps a setting."""
    _, lib = load()
    lib.stella_optim_set_tuning(int(prefetch_distance), int(tile), int(mode))


def _flat(a: np.ndarray, dtype: type, what: str) -> None:
    """A probe's array argument: a contiguous 1-D array of ``dtype``, else ValueError."""
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"probe {what} must be a contiguous 1-D {np.dtype(dtype).name} array")


def probe_random_rmw(buf: np.ndarray, idx: np.ndarray, stride: int, prefetch_distance: int = 16) -> None:
    """Roofline: ``buf[idx * stride] = buf[idx * stride] * 0.5 + 1`` in C, prefetched.

    The cheapest update of the lines an optimizer step touches; bench/kernel.py
    times it to show how close the kernel gets to the machine's random-access floor.
    """
    from stella.native_errors import check

    _flat(buf, np.float32, "buffer")
    _flat(idx, np.int32, "indices")
    ffi, lib = load()
    rc = lib.stella_probe_random_rmw(ffi.from_buffer("float[]", buf, require_writable=True), buf.shape[0],
                                     ffi.from_buffer("int32_t[]", idx), idx.shape[0], int(stride),
                                     int(prefetch_distance))
    check(lib, rc, "probe", ValueError)


def probe_layout(mem: np.ndarray, numel: int, layout: int, phase: int, idx: np.ndarray, g: np.ndarray,
                 prefetch_distance: int = 16) -> None:
    """The memory of a server step at ``idx`` (sorted) with the broadcast's ``R`` and ``B``
    beside the AdamW record (``layout`` 0: ``mem`` holds ``6 numel`` floats, the records then
    R then B) or inside it (1: ``8 numel``, one 32-byte record a coordinate), or the records
    alone (2: the first ``4 numel``, phase 0 only): ``phase`` 0 the apply (record updated
    from ``g``, its change added to R), 1 the selection (R read and zeroed, B gains it).
    bench/layouts.py times it (native/bench/probe.c)."""
    from stella.native_errors import check

    need = numel * {0: 6, 1: 8}.get(layout, 4)
    _flat(mem, np.float32, "memory")
    if mem.shape[0] < need:
        raise ValueError(f"probe memory must hold at least {need} floats")
    _flat(idx, np.int32, "indices")
    _flat(g, np.float32, "values")
    if g.shape[0] != idx.shape[0]:
        raise ValueError("probe indices and values differ in length")
    ffi, lib = load()
    rc = lib.stella_probe_layout(ffi.from_buffer("float[]", mem, require_writable=True), int(numel), int(layout),
                                 int(phase), ffi.from_buffer("int32_t[]", idx), ffi.from_buffer("float[]", g),
                                 idx.shape[0], int(prefetch_distance))
    check(lib, rc, "probe", ValueError)
