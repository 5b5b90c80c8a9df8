/* k-way union of sorted unique index lists: the pull delta since a version is the
 * union of the steps' touched sets. */
#include <stdlib.h>
#include <string.h>

#include "optim_internal.h"

/* Union of two sorted unique lists; returns its length. */
static int64_t union2(const int32_t *a, int64_t na, const int32_t *b, int64_t nb, int32_t *out) {
    int64_t i = 0, j = 0, n = 0;
    while (i < na && j < nb) {
        int32_t x = a[i], y = b[j];
        int32_t m = x < y ? x : y;
        out[n++] = m;
        i += x == m;
        j += y == m;
    }
    while (i < na) out[n++] = a[i++];
    while (j < nb) out[n++] = b[j++];
    return n;
}

/* Pairwise rounds of two-way unions: O(N log k) for any k, and every round is a
 * streaming pass that the hardware prefetcher follows. */
int64_t stella_union_indices(const int32_t *const *lists, const int64_t *lens, int32_t k, int32_t *out,
                             int64_t out_cap) {
    if (k < 0 || (k > 0 && (!lists || !lens))) return STELLA_E_ARG;
    int64_t total = 0;
    for (int i = 0; i < k; i++) {
        if (lens[i] < 0 || (lens[i] > 0 && !lists[i])) return STELLA_E_ARG;
        total += lens[i];
    }
    if (out_cap < total || (total > 0 && !out)) return STELLA_E_ARG;
    if (k == 0 || total == 0) return 0;
    if (k == 1) {
        memcpy(out, lists[0], (size_t)lens[0] * 4);
        return lens[0];
    }
    if (k == 2) return union2(lists[0], lens[0], lists[1], lens[1], out);
    /* Runs live back to back in one of two buffers; merge neighbours each round. */
    int32_t *buf[2];
    buf[0] = malloc((size_t)total * 4);
    buf[1] = malloc((size_t)total * 4);
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(k + 1));
    if (!buf[0] || !buf[1] || !start) {
        free(buf[0]);
        free(buf[1]);
        free(start);
        return STELLA_E_NOMEM;
    }
    int64_t pos = 0;
    for (int i = 0; i < k; i++) {
        start[i] = pos;
        memcpy(buf[0] + pos, lists[i], (size_t)lens[i] * 4);
        pos += lens[i];
    }
    start[k] = pos;
    int runs = k, src = 0;
    while (runs > 1) {
        int dst = src ^ 1, nr = 0;
        int64_t wpos = 0;
        for (int r = 0; r < runs; r += 2) {
            int64_t s0 = start[r], e0 = start[r + 1];
            int64_t len;
            if (r + 1 < runs) {
                int64_t e1 = start[r + 2];
                len = union2(buf[src] + s0, e0 - s0, buf[src] + e0, e1 - e0, buf[dst] + wpos);
            } else {
                len = e0 - s0;
                memcpy(buf[dst] + wpos, buf[src] + s0, (size_t)len * 4);
            }
            start[nr++] = wpos;
            wpos += len;
        }
        start[nr] = wpos;
        runs = nr;
        src = dst;
    }
    int64_t n = start[1];
    memcpy(out, buf[src], (size_t)n * 4);
    free(buf[0]);
    free(buf[1]);
    free(start);
    return n;
}

/* Whether every idx[j], j < n, lies in [0, numel) (any order). */
static int in_range(const int32_t *idx, int64_t n, int64_t numel) {
    for (int64_t j = 0; j < n; j++)
        if (STELLA_UNLIKELY(idx[j] < 0 || idx[j] >= numel)) return 0;
    return 1;
}

/* dst[idx[j]] += src[j] for j < n, in float32 (idx: in [0, numel), any order; a repeated
 * index adds each time). One pass, no temporaries: the broadcast's residual and model
 * updates, where NumPy's fancy-index += gathers, adds and scatters in three. */
int stella_scatter_add(float *dst, int64_t numel, const int32_t *idx, const float *src, int64_t n) {
    if (n < 0 || numel < 0 || (n > 0 && (!dst || !idx || !src))) return STELLA_E_ARG;
    if (!in_range(idx, n, numel)) return STELLA_E_RANGE;
    for (int64_t j = 0; j < n; j++) dst[idx[j]] += src[j];
    return STELLA_OK;
}

/* A tile at a time (stella_native.h, STELLA_ADD_TILE), the next tile's lines asked for
 * at once. Unlike the broadcast's pass, the sweep has only the adds to spread the
 * requests between: a step at a time (STELLA_ADD_STEP) it was slower, 512 floats at a
 * time the same (Zen 4 VM, 2026-11-28). */
int stella_scatter_add_lists(float *dst, int64_t numel, const stella_sparse_list *lists, int32_t nlists) {
    if (numel < 0 || nlists < 0 || (nlists > 0 && !lists)) return STELLA_E_ARG;
    const int rc = stella_check_lists(lists, nlists, numel);
    if (rc != STELLA_OK || nlists == 0) return rc;
    for (int32_t l = 0; l < nlists; l++)
        if (lists[l].n > 0 && !dst) return STELLA_E_ARG;
    int64_t *cursor = calloc((size_t)nlists, sizeof *cursor);
    if (!cursor) return STELLA_E_NOMEM;
    stella_prefetch_lines(dst, 0, STELLA_ADD_TILE, numel);
    for (int64_t lo = 0; lo < numel; lo += STELLA_ADD_TILE) {
        const int64_t hi = numel - lo < STELLA_ADD_TILE ? numel : lo + STELLA_ADD_TILE;
        stella_prefetch_lines(dst, hi, STELLA_ADD_TILE, numel);
        stella_add_lists_below(dst, lists, nlists, cursor, hi);
    }
    free(cursor);
    return STELLA_OK;
}
