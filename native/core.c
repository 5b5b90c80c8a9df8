/* Compiled into both native modules: the ABI version, the text of the return codes,
 * and the one order/range check of sorted sparse index arrays. */
#include "stella_native.h"

int stella_abi_version(void) { return STELLA_ABI_VERSION; }

const char *stella_strerror(int rc) {
    switch (rc) {
    case STELLA_OK: return "ok";
    case STELLA_E_RANGE: return "index out of range";
    case STELLA_E_ORDER: return "indices not sorted strictly increasing (unsorted or duplicated)";
    case STELLA_E_NONFINITE: return "NaN/Inf value";
    case STELLA_E_CORRUPT: return "corrupt or truncated coded bytes";
    case STELLA_E_ARG: return "bad argument";
    case STELLA_E_NOMEM: return "out of memory";
    case STELLA_E_SCALE: return "q4/q2 scale negative, NaN or Inf";
    default: return "unknown error";
    }
}

/* STELLA_OK when idx[0..n) is strictly increasing and inside [0, numel); otherwise
 * STELLA_E_RANGE or STELLA_E_ORDER for the first offending entry, whose position
 * goes to *where (when not NULL). */
int stella_check_sorted(const int32_t *idx, int64_t n, int64_t numel, int64_t *where) {
    int64_t prev = -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t x = idx[i];
        int rc = STELLA_OK;
        if (STELLA_UNLIKELY(x < 0 || x >= numel)) rc = STELLA_E_RANGE;
        else if (STELLA_UNLIKELY(x <= prev)) rc = STELLA_E_ORDER;
        if (STELLA_UNLIKELY(rc != STELLA_OK)) {
            if (where) *where = i;
            return rc;
        }
        prev = x;
    }
    return STELLA_OK;
}
