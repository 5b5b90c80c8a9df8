"""The native boundary: two modules by owner, one checked-call helper, C constants via cffi."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from stella import native_errors
from stella._native import lib as client_lib
from stella.compress import BLOCK, ErrorFeedbackCompressor
from stella.errors import CodecError
from stella_ps import kernel
from stella_ps._kernel import lib as server_lib
from stella_ps.errors import KernelError, KernelInputError, StellaPSError


@pytest.mark.parametrize("lib", [client_lib, server_lib], ids=["client", "server"])
def test_abi_and_error_text_come_from_c(lib):
    native_errors.require_abi(lib, "x")  # does not raise
    assert lib.STELLA_ABI_VERSION == lib.stella_abi_version() == native_errors.ABI_VERSION
    codes = [lib.STELLA_E_RANGE, lib.STELLA_E_ORDER, lib.STELLA_E_NONFINITE, lib.STELLA_E_CORRUPT,
             lib.STELLA_E_ARG, lib.STELLA_E_NOMEM]
    assert len(set(codes)) == len(codes) and all(c < 0 for c in codes) and lib.STELLA_OK == 0
    texts = [native_errors.strerror(lib, c) for c in codes]
    assert len(set(texts)) == len(texts) and "unknown" not in " ".join(texts)
    assert native_errors.check(lib, 7, "x", CodecError) == 7
    with pytest.raises(CodecError, match=r"what: index out of range \(code -1\)"):
        native_errors.check(lib, lib.STELLA_E_RANGE, "what", CodecError)
    with pytest.raises(MemoryError):
        native_errors.check(lib, lib.STELLA_E_NOMEM, "what", CodecError)
    with pytest.raises(KernelInputError):
        native_errors.check(lib, lib.STELLA_E_ORDER, "what", {lib.STELLA_E_ORDER: KernelInputError, None: KernelError})
    with pytest.raises(KernelError):
        native_errors.check(lib, lib.STELLA_E_ARG, "what", {lib.STELLA_E_ORDER: KernelInputError, None: KernelError})


def test_stale_build_fails_the_import():
    class Stale:
        STELLA_ABI_VERSION = native_errors.ABI_VERSION - 1

        @staticmethod
        def stella_abi_version():
            return native_errors.ABI_VERSION - 1

    with pytest.raises(ImportError, match="make install"):
        native_errors.require_abi(Stale, "stale")


def test_each_package_owns_its_c():
    """The client module has no optimizer, the server module no codec, and neither
    ships the benchmark knobs."""
    client, server = set(dir(client_lib)), set(dir(server_lib))
    assert "stella_idx_decode" in client and "stella_ef_topk" in client
    assert not any(n.startswith(("stella_optim", "stella_union")) for n in client)
    assert "stella_optim_apply" in server and "stella_union_indices" in server
    assert not any(n.startswith(("stella_idx", "stella_ef_", "stella_f16")) for n in server)
    for name in ("stella_optim_set_tuning", "stella_probe_random_rmw"):
        assert name not in client | server
    assert not hasattr(kernel, "set_tuning") and not hasattr(kernel, "probe_random_rmw")
    assert BLOCK == client_lib.STELLA_BLOCK


def test_server_imports_no_private_client_module():
    import stella_ps

    for path in pathlib.Path(stella_ps.__file__).parent.glob("*.py"):
        src = path.read_text()
        assert "from stella._" not in src and "import stella._" not in src, path.name


def test_server_errors_have_one_root():
    assert issubclass(KernelInputError, StellaPSError) and issubclass(KernelInputError, ValueError)
    assert issubclass(KernelError, StellaPSError) and issubclass(KernelError, RuntimeError)
    assert kernel.KernelInputError is KernelInputError


def test_sortedness_check_reports_position():
    cfg = _cfg()
    state = kernel.KernelTensorState(np.zeros(5, np.float32), cfg)
    with pytest.raises(KernelInputError, match="index 9 at position 2 is outside"):
        state.apply([(np.array([1, 2, 9], np.int32), np.ones(3, np.float32))], 1.0, cfg)
    with pytest.raises(KernelInputError, match="not strictly increasing at position 1"):
        kernel.union_indices([np.array([3, 3], np.int32)])


def _cfg():
    from stella_ps.optim import OptimizerConfig

    return OptimizerConfig.from_wire({"name": "sgd", "lr": 0.1})


@pytest.mark.parametrize("method", ["threshold", "block"])
def test_select_stats_are_filled_per_key(method):
    comp = ErrorFeedbackCompressor(density=0.01, method=method, backend="native")
    comp.compress("w", torch.randn(100_000))
    stats = comp.select_stats("w")
    assert set(stats) == {"passes", "estimates", "trims", "givebacks", "units", "exact_fallback"}
    assert stats["passes"] >= 1 and stats["estimates"] >= 1
    k_units = 1000 if method == "threshold" else round(1000 / BLOCK)
    assert 0.9 * k_units <= stats["units"] <= 1.1 * k_units + 1
    torch_comp = ErrorFeedbackCompressor(density=0.01, method=method, backend="torch")
    torch_comp.compress("w", torch.randn(100_000))
    assert torch_comp.select_stats("w") is None
