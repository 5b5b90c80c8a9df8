"""Slow-link test bed (network namespaces + tbf).  See docs/testbed.md."""

from .testbed import (  # noqa: F401
    TBF_QUEUE_MS,
    Link,
    NetnsUnavailableError,
    NotRootError,
    TestbedError,
    WanTestbed,
    cleanup_stale,
    netns_available,
    tbf_burst_bytes,
)
