/* The broadcast's candidate pool (stella_ps/broadcast.py; docs/optimizer.md,
 * "Selecting without reading all of R"): one call adds a step's change to the
 * residual at the touched coordinates, reads |R| there and at the pool's, and takes
 * the top k of those that reach the pool's floor out of R; the rest are the next
 * pool. Both lists are sorted, so R is read in two forward sweeps (the touched
 * coordinates, then the pool's) that skip what no candidate needs, and a touched
 * coordinate's change and read are one access. */
#include <string.h>

#include "optim_internal.h"

#define PF_AHEAD 32 /* coordinates ahead to prefetch: R is out of cache after a step's other work */
#define HI_SHIFT 20 /* the sweep's histogram: the top 11 of a key's 31 bits */
#define HI_BINS 2048
#define LO_BINS 1024 /* then two passes of 10 bits over the one bin that holds a rank */

static inline uint32_t abs_key(float x) { return stella_f32_bits(x) & 0x7fffffffu; }

/* The key (bits of |v|) of the rank-th largest |v[i]| (1 <= rank <= m), given hist:
 * the count of keys in each of the HI_BINS. One pass over v gathers the bin that holds
 * the rank into sub (room for m); two radix passes over that bin alone find the rest
 * of the key. above (unless NULL): how many keys are larger than it. */
static uint32_t rank_key(const float *v, int64_t m, const uint32_t *hist, int64_t rank, uint32_t *sub,
                         int64_t *above) {
    uint32_t b = HI_BINS - 1;
    for (; b > 0 && (int64_t)hist[b] < rank; b--) rank -= hist[b];
    int64_t ns = 0;
    for (int64_t i = 0; i < m; i++) {
        uint32_t key = abs_key(v[i]);
        sub[ns] = key;
        ns += (key >> HI_SHIFT) == b;
    }
    uint32_t lo[LO_BINS], prefix = b << HI_SHIFT, mask = ~0u << HI_SHIFT;
    for (int shift = 10; shift >= 0; shift -= 10) {
        memset(lo, 0, sizeof lo);
        for (int64_t i = 0; i < ns; i++)
            if ((sub[i] & mask) == prefix) lo[(sub[i] >> shift) & (LO_BINS - 1)]++;
        uint32_t d = LO_BINS - 1;
        for (; d > 0 && (int64_t)lo[d] < rank; d--) rank -= lo[d];
        prefix |= d << shift;
        mask |= (uint32_t)(LO_BINS - 1) << shift;
    }
    if (above) { /* the bins above b, and the keys of bin b above the result */
        int64_t n = 0;
        for (uint32_t c = b + 1; c < HI_BINS; c++) n += hist[c];
        for (int64_t i = 0; i < ns; i++) n += sub[i] > prefix;
        *above = n;
    }
    return prefix;
}

static int sorted_in_range(const int32_t *a, int64_t n, int64_t numel) {
    for (int64_t i = 0; i < n; i++)
        if (STELLA_UNLIKELY(a[i] < 0 || a[i] >= numel || (i > 0 && a[i] <= a[i - 1]))) return 0;
    return 1;
}

int stella_pool_pick(float *r, int64_t numel, const int32_t *touched, const float *ch, int64_t nt,
                     const int32_t *pool, int64_t np, float floor, int64_t k, int64_t cut_above, int64_t cut_to,
                     int32_t full, int32_t *sel, float *val, int64_t *n_sel, int32_t *rest, int64_t *n_rest,
                     float *floor_out, uint32_t *scratch, int64_t scratch_len) {
    if (!r || numel < 0 || nt < 0 || np < 0 || k < 0 || cut_to < 0 || cut_above < cut_to || !n_sel || !n_rest ||
        !floor_out || (nt > 0 && (!touched || !ch)) || (np > 0 && !pool) || (nt + np > 0 && !rest) ||
        (k > 0 && (!sel || !val)) || !(floor >= 0.0f) || scratch_len < 3 * (nt + np) || (scratch_len > 0 && !scratch))
        return STELLA_E_ARG;
    if (!sorted_in_range(touched, nt, numel) || !sorted_in_range(pool, np, numel)) return STELLA_E_RANGE;
    *n_sel = *n_rest = 0;
    *floor_out = floor;
    /* kept/kval: the candidates, the touched ones' then the pool's (each run sorted);
     * sub: rank_key's scratch. */
    size_t cap = (size_t)(nt + np);
    int32_t *kept = (int32_t *)scratch;
    float *kval = (float *)(scratch + cap);
    uint32_t *sub = scratch + 2 * cap;
    uint32_t fkey = abs_key(floor), hist[HI_BINS];
    memset(hist, 0, sizeof hist);
    /* Two sweeps, each in index order: the touched coordinates (R += change), then the
     * pool's not touched. One list at a time, no load of R waits on a comparison of the
     * lists. A coordinate whose |R| reaches the floor (and is not zero: a zero is never
     * owed) is kept, and counted in the histogram of its key's top bits. The appends
     * are branch-free. */
    int64_t mt = 0, m = 0;
    for (int64_t i = 0; i < nt; i++) {
        if (i + PF_AHEAD < nt) __builtin_prefetch(r + touched[i + PF_AHEAD], 1, 0);
        int32_t c = touched[i];
        float x = r[c] + ch[i];
        r[c] = x;
        uint32_t key = abs_key(x);
        int keep = key >= fkey && key > 0;
        kept[mt] = c;
        kval[mt] = x;
        hist[key >> HI_SHIFT] += (uint32_t)keep;
        mt += keep;
    }
    m = mt;
    int64_t ti = 0;
    for (int64_t j = 0; j < np; j++) {
        if (j + PF_AHEAD < np) __builtin_prefetch(r + pool[j + PF_AHEAD], 0, 0);
        int32_t c = pool[j];
        float x = r[c];
        while (ti < nt && touched[ti] < c) ti++;
        uint32_t key = abs_key(x);
        int keep = key >= fkey && key > 0 && !(ti < nt && touched[ti] == c);
        kept[m] = c;
        kval[m] = x;
        hist[key >> HI_SHIFT] += (uint32_t)keep;
        m += keep;
    }
    if (m < k && !full) return STELLA_POOL_DRY;
    /* The top k: every candidate above the k-th largest, and as many of those equal to
     * it as make k, the first in index order. A pool grown past cut_above keeps its
     * cut_to largest (those above the (k + cut_to + 1)-th largest of all), and the
     * floor rises to the largest it drops (ties with that go too: they are at most the
     * floor). */
    int64_t take = m < k ? m : k, ties = 0;
    uint32_t tau = 0, drop = 0;
    int all = take == m, cut = m - take > cut_above;
    if (!all) {
        int64_t above;
        tau = rank_key(kval, m, hist, take, sub, &above);
        ties = take - above;
        if (cut) drop = rank_key(kval, m, hist, take + cut_to + 1, sub, NULL);
    }
    /* Out in index order: the two sorted runs merged as they are written. */
    int64_t ns = 0, nr = 0, a = 0, b = mt;
    for (int64_t q = 0; q < m; q++) {
        int from_a = b >= m || (a < mt && kept[a] < kept[b]);
        int64_t at = from_a ? a : b;
        a += from_a;
        b += !from_a;
        int32_t c = kept[at];
        float x = kval[at];
        uint32_t key = abs_key(x);
        int tie = key == tau && ties > 0;
        ties -= tie;
        int s = all | (key > tau) | tie;
        sel[ns] = c;
        val[ns] = x;
        ns += s;
        rest[nr] = c;
        nr += (!s) & (!cut | (key > drop)); /* branch-free: both sides are 0 or 1 */
    }
    for (int64_t q = 0; q < ns; q++) r[sel[q]] = 0.0f;
    if (cut && stella_bits_f32(drop) > floor) *floor_out = stella_bits_f32(drop);
    *n_sel = ns;
    *n_rest = nr;
    return STELLA_OK;
}
