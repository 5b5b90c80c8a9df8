"""The client's selection: :class:`~stella.native_select.Selection` over ``stella._native``
(the compressor's top-k, :mod:`stella.compress`)."""
from __future__ import annotations

from ._native import ffi, lib
from .native_select import Selection, SelectStats, TopkState

__all__ = ["SELECT", "BLOCK", "TopkState", "SelectStats"]

SELECT = Selection(ffi, lib, "stella._native")
BLOCK: int = SELECT.block  # floats per block of the "block" method (native/cdefs/compress.h)
