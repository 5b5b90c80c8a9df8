/* Validation of untrusted sparse pushes, run before anything touches state. */
#include "stella_native.h"

int stella_abi_version(void) { return STELLA_ABI_VERSION; }

/* Returns -1 when idx[0..n) is strictly increasing and inside [0, numel);
 * otherwise the position of the first offending entry, encoded as
 * pos * 4 + reason (reason 1: out of range, 2: not strictly increasing). */
int64_t stella_check_sparse(const int32_t *idx, int64_t n, int64_t numel) {
    int64_t prev = -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t x = idx[i];
        if (STELLA_UNLIKELY(x < 0 || x >= numel)) return i * 4 + 1;
        if (STELLA_UNLIKELY(x <= prev)) return i * 4 + 2;
        prev = x;
    }
    return -1;
}
