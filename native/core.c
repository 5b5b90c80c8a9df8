/* Compiled into both native modules: the ABI version, the text of the return codes,
 * the one order/range check of sorted sparse index arrays, and the choice of the
 * x86-64 level the dispatched kernels run at (stella_isa.h). */
#include <stdatomic.h>
#include <stdlib.h>

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

#define CHECK_BLOCK 256 /* entries the branch-free pass tests at a time */

/* STELLA_OK when idx[0..n) is strictly increasing and inside [0, numel); otherwise
 * STELLA_E_RANGE or STELLA_E_ORDER for the first offending entry, whose position
 * goes to *where (when not NULL). */
int stella_check_sorted(const int32_t *idx, int64_t n, int64_t numel, int64_t *where) {
    /* Whole blocks first, without branches (the compiler vectorises both loops): an
     * entry outside [0, lim) or not above its predecessor marks its block, and the
     * scalar loop below then finds the first offender from that block's start. */
    const uint32_t lim = numel < 0 ? 0 : (numel > (int64_t)INT32_MAX ? (uint32_t)INT32_MAX + 1u : (uint32_t)numel);
    int64_t i0 = 0;
    for (; i0 + CHECK_BLOCK <= n; i0 += CHECK_BLOCK) {
        const int32_t *b = idx + i0;
        uint32_t bad = i0 > 0 ? (uint32_t)(b[0] <= b[-1]) : 0u;
        for (int j = 1; j < CHECK_BLOCK; j++) bad |= (uint32_t)(b[j] <= b[j - 1]);
        for (int j = 0; j < CHECK_BLOCK; j++) bad |= (uint32_t)((uint32_t)b[j] >= lim);
        if (bad) break;
    }
    int64_t prev = i0 > 0 ? idx[i0 - 1] : -1;
    for (int64_t i = i0; i < n; i++) {
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

/* ---- run-time ISA level (stella_isa.h) ------------------------------------- */

static const char *const isa_names[STELLA_ISA_LEVELS] = STELLA_ISA_NAMES;
/* What STELLA_NATIVE_ISA may ask for: "auto" (or unset, or empty), a level's name;
 * anything else reads as "unknown" and is treated as auto. */
#define REQ_AUTO 0
#define REQ_UNKNOWN (STELLA_ISA_LEVELS + 1)
static const char *const isa_requests[] = {"auto", "portable", "x86-64-v3", "x86-64-v4", "unknown"};
_Static_assert(sizeof isa_requests / sizeof *isa_requests == REQ_UNKNOWN + 1, "one request a level");

/* Levels this module holds and this CPU runs (bit 1 << STELLA_ISA_*). The levels'
 * checks include the operating system's support of the wider registers. */
static int isa_runnable(void) {
    int mask = 1 << STELLA_ISA_PORTABLE;
#if STELLA_ISA_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v3")) mask |= 1 << STELLA_ISA_V3;
    if (__builtin_cpu_supports("x86-64-v4")) mask |= 1 << STELLA_ISA_V4;
#endif
    return mask;
}

/* 0 until resolved, then 0x100 | request << 4 | level. A race of two first calls
 * resolves twice, to the same value. */
static atomic_int isa_state;

static int isa_resolve(void) {
    int req = REQ_AUTO;
    const char *env = getenv("STELLA_NATIVE_ISA");
    if (env && *env) {
        req = REQ_UNKNOWN;
        for (int r = 0; r < REQ_UNKNOWN; r++)
            if (!strcmp(env, isa_requests[r])) req = r;
    }
    const int mask = isa_runnable();
    /* the level asked for, or the best one this CPU runs when it lacks that */
    int level = (req == REQ_AUTO || req == REQ_UNKNOWN) ? STELLA_ISA_LEVELS - 1 : req - 1;
    while (level > STELLA_ISA_PORTABLE && !(mask & (1 << level))) level--;
    return 0x100 | req << 4 | level;
}

static int isa_state_get(void) {
    int s = atomic_load_explicit(&isa_state, memory_order_relaxed);
    if (STELLA_UNLIKELY(!s)) {
        s = isa_resolve();
        atomic_store_explicit(&isa_state, s, memory_order_relaxed);
    }
    return s;
}

int stella_isa_level(void) { return isa_state_get() & 0xf; }

/* The level the dispatched kernels run at: "portable", "x86-64-v3" or "x86-64-v4". */
const char *stella_native_isa(void) { return isa_names[stella_isa_level()]; }

/* What STELLA_NATIVE_ISA asked for when the level was chosen: "auto", a level's name,
 * or "unknown". A level other than stella_native_isa() means it fell back. */
const char *stella_native_isa_requested(void) { return isa_requests[(isa_state_get() >> 4) & 0xf]; }

/* Bit 1 << STELLA_ISA_* for every level compiled into this module (runnable == 0), or
 * for those this CPU also runs (runnable != 0). */
int stella_native_isa_levels(int runnable) {
    const int compiled = STELLA_ISA_DISPATCH ? (1 << STELLA_ISA_LEVELS) - 1 : 1 << STELLA_ISA_PORTABLE;
    return runnable ? compiled & isa_runnable() : compiled;
}
