/* Shared prelude of every native/ source: fixed-width types, ABI version, return
 * codes, value dtypes and bit casts. Python reads the constants through cffi
 * (cdefs/core.h declares them as `...`, filled from here at build time). */
#ifndef STELLA_NATIVE_H
#define STELLA_NATIVE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "stella_isa.h"

/* Bumped whenever a signature or a struct in native/cdefs changes; the Python
 * wrappers (stella.native_errors.require_abi) assert it at import so a stale build
 * fails loudly. */
#define STELLA_ABI_VERSION 13

/* Return codes shared by all kernels (0 = ok, negative = error); stella_strerror()
 * has their text. */
#define STELLA_OK 0
#define STELLA_E_RANGE (-1)     /* an index is >= the tensor's size */
#define STELLA_E_ORDER (-2)     /* indices not strictly increasing */
#define STELLA_E_NONFINITE (-3) /* a value is NaN or +-Inf */
#define STELLA_E_CORRUPT (-4)   /* coded bytes are malformed or truncated */
#define STELLA_E_ARG (-5)       /* bad argument (size, count, config) */
#define STELLA_E_NOMEM (-6)     /* allocation failed */
#define STELLA_E_SCALE (-7)     /* a q4/q2 scale is negative, NaN or +-Inf */

/* Value dtypes of wire frames and of pushes (bf16 travels as uint16 bit patterns).
 * q4/q2 (per-chunk scaled 4-/2-bit codes, codec.c) exist only on the wire: they are
 * dequantised to float32 before anything else reads them, and the kernel refuses them. */
#define STELLA_VAL_F32 0
#define STELLA_VAL_F16 1
#define STELLA_VAL_BF16 2
#define STELLA_VAL_Q4 3
#define STELLA_VAL_Q2 4

#if defined(__GNUC__)
#define STELLA_LIKELY(x) __builtin_expect(!!(x), 1)
#define STELLA_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define STELLA_RESTRICT __restrict__
#else
#define STELLA_LIKELY(x) (x)
#define STELLA_UNLIKELY(x) (x)
#define STELLA_RESTRICT
#endif

/* A float's bit pattern and back, without aliasing games. */
static inline uint32_t stella_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float stella_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Little-endian 32-bit words in byte buffers (the codecs' frames). */
static inline void stella_store32le(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}
static inline uint32_t stella_load32le(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The most elements a coded tensor may have (indices are int32, counts fit 31 bits). */
#define STELLA_MAX_CODED_NUMEL (INT64_C(1) << 31)

/* The first position j of the sorted a[0..n) with a[j] >= x (n when none). */
static inline int64_t stella_lower_bound(const int32_t *a, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if ((int64_t)a[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* core.c, compiled into both modules. */
int stella_abi_version(void);
const char *stella_strerror(int rc);
int stella_check_sorted(const int32_t *idx, int64_t n, int64_t numel, int64_t *where);
const char *stella_native_isa(void);
const char *stella_native_isa_requested(void);
int stella_native_isa_levels(int runnable);

/* A sparse change to a tensor: n sorted, unique indices in [0, its size) and their
 * values (stella_ef_topk_add's adds, stella_scatter_add_lists' lists). */
typedef struct {
    const int32_t *idx;
    const float *val;
    int64_t n;
} stella_sparse_list;

/* STELLA_OK when each of the nlists lists is well formed (n >= 0, its arrays given
 * when n > 0) and its indices strictly increase inside [0, numel); else the first
 * offender's STELLA_E_ARG, STELLA_E_RANGE or STELLA_E_ORDER. */
static inline int stella_check_lists(const stella_sparse_list *list, int32_t nlists, int64_t numel) {
    for (int32_t l = 0; l < nlists; l++) {
        if (list[l].n < 0 || (list[l].n > 0 && (!list[l].idx || !list[l].val))) return STELLA_E_ARG;
        const int rc = stella_check_sorted(list[l].idx, list[l].n, numel, NULL);
        if (rc != STELLA_OK) return rc;
    }
    return STELLA_OK;
}

/* Sparse lists added to an array as a sweep goes over it: a tile of STELLA_ADD_TILE
 * floats at a time, the tile's share of every list, with the lines of the tile after
 * it asked for ahead (the adds alone are scattered misses that the hardware's stream
 * prefetcher does not follow). At 0.6% of coordinates touched, the broadcast's tiled
 * pass was 10% slower than a scatter and a plain pass without the prefetch, 10% faster
 * with it.
 *
 * The requests go out a step (STELLA_ADD_STEP floats, 4 lines) at a time as the sweep
 * goes, one tile ahead of it, not a whole tile's 256 at once: a burst of requests
 * overruns the core's miss buffers and the rest are dropped. On a Zen 4 VM the
 * broadcast's step (8 tensors of 1.25M, 1%) went from 12.3-13.0 ms to 7.9-8.3 ms. */
#define STELLA_ADD_TILE 4096
#define STELLA_ADD_STEP 64

/* Ask for the lines of a[lo .. min(lo + len, n)), for writing (none when lo >= n): a
 * tile (STELLA_ADD_TILE) at once, as a pass starts and as a sweep of adds alone goes
 * (union.c), or a step (STELLA_ADD_STEP) a tile ahead of the broadcast's pass. */
static inline void stella_prefetch_lines(const float *a, int64_t lo, int64_t len, int64_t n) {
    const int64_t hi = n - lo < len ? n : lo + len;
    for (int64_t c = lo; c < hi; c += 16) __builtin_prefetch(a + c, 1, 3);
}

/* a[idx] += val for the entries of each list from cursor[l] up to the first index >= hi,
 * list after list (their order at a coordinate); the cursors move past them. */
static inline void stella_add_lists_below(float *a, const stella_sparse_list *list, int32_t nlists,
                                          int64_t *cursor, int64_t hi) {
    for (int32_t l = 0; l < nlists; l++) {
        const int32_t *il = list[l].idx;
        const float *vl = list[l].val;
        const int64_t nl = list[l].n;
        int64_t j = cursor[l];
        for (; j < nl && il[j] < hi; j++) a[il[j]] += vl[j];
        cursor[l] = j;
    }
}

/* The most threads one stella_run_jobs call runs on. */
#define STELLA_MAX_JOBS 64

/* fn(job t) for the T jobs of the array at jobs (each size bytes): jobs 1.. on threads of their own, job 0 on
 * the caller's, and a job whose thread could not be started on the caller's too, after job 0; returns when
 * every one is done. The kernels' ranges (an apply, a gather, the selection's pass) each run this way. */
static inline void stella_run_jobs(void *(*fn)(void *), void *jobs, size_t size, int T) {
    pthread_t tid[STELLA_MAX_JOBS];
    int started[STELLA_MAX_JOBS] = {0};
    char *base = (char *)jobs;
    if (T > STELLA_MAX_JOBS) T = STELLA_MAX_JOBS;
    for (int t = 1; t < T; t++) started[t] = pthread_create(&tid[t], NULL, fn, base + (size_t)t * size) == 0;
    fn(base);
    for (int t = 1; t < T; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            fn(base + (size_t)t * size);
    }
}

#endif
