/* Validation of untrusted sparse pushes, run before anything touches state. */
#include <math.h>

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

/* Position of the first NaN/Inf in val[0..n), or -1. Branch-free inner block so
 * the common all-finite case vectorises. */
int64_t stella_first_nonfinite_f32(const float *val, int64_t n) {
    const int64_t B = 1024;
    for (int64_t s = 0; s < n; s += B) {
        int64_t e = s + B < n ? s + B : n;
        int bad = 0;
        for (int64_t i = s; i < e; i++) {
            uint32_t u;
            __builtin_memcpy(&u, &val[i], 4);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
        if (bad)
            for (int64_t i = s; i < e; i++)
                if (!isfinite(val[i])) return i;
    }
    return -1;
}
