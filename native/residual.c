/* The broadcast's flat residual R and an index of its largest magnitudes, kept current
 * as R changes (stella_ps/residual.py wraps it; API: cdefs/residual.h).
 *
 * A step adds its change at the coordinates it touched (R[idx] += val), then takes the k
 * coordinates of largest |R| out of R. A streaming top-k reads all of R each step, so its
 * cost grows with the model; here a step costs O(touched + k + the boundary bucket), and
 * nothing grows with numel at a fixed touched count and k.
 *
 * Buckets. A coordinate's bucket is its |R|'s bit pattern shifted right by 19: the float's
 * exponent and top 4 mantissa bits, 16 buckets an octave (bucket 0 is R == 0, every
 * nonzero value is in 1..4081, and the order of buckets is the order of magnitudes). Each
 * group (a contiguous range of [0, sparse_numel) with its own quota) keeps, for every
 * bucket at or above its *floor*, a list of the coordinates in it and their count.
 * Coordinates below the floor are not tracked: each is smaller than every tracked one,
 * so while at least k are tracked, the top k of the tracked ones is the top k of R.
 *
 * Lists are append-only with lazy deletion. An add reads R[c] before and after; when the
 * bucket changes, c is appended to its new bucket's list (when tracked) and the old
 * list's count drops, its entry left stale. An entry c of list b is valid iff
 * bucket(R[c]) == b, read from R itself: the index holds nothing per coordinate. A
 * coordinate that leaves a bucket and comes back is listed there twice; a scan that finds
 * more valid entries than the count removes the second ones (R set to 0 at each kept
 * entry, so that its next one reads as stale, and put back after). A list with more than
 * twice as many entries as its count, plus 64, is compacted on the spot: O(1) amortised
 * per move, each compaction following as many moves out of the list as it drops. An add
 * runs in batches of 1024 entries: first R's reads and writes, noting without a branch
 * the coordinates whose bucket changed at or above the floor, then their lists.
 *
 * Selection. The counts tell, walking down from the highest bucket, which buckets go
 * whole (count <= what is still wanted) and which one is the boundary. Whole buckets are
 * scanned and emptied (R read once, at random, per entry: the cost of a selection); the
 * boundary's valid entries get 64-bit keys (|R|'s bits, then the complement of the index:
 * ties go to the lower index) and a radix select finds the rank wanted; the rest are the
 * bucket's new list. The selected (index, value) pairs are radix-sorted by index
 * (ceil(log2(group size) / 11) passes) and R is +0 there. At 16 buckets an octave the
 * boundary holds a small share of k for smooth distributions (~0.6 k in bench.residual's
 * steady state).
 *
 * The floor. It starts at bucket 1 (every nonzero tracked) and rises, never falls except
 * through a full pass: after each selection its candidate is the lower of the lowest
 * bucket selected less MARGIN (1/8 octave) and the highest bucket that keeps RESERVE (4)
 * x k tracked; the floor rises to the lowest candidate of the last RAISE_AFTER (4)
 * selections (a step of large changes, or one small k, does not lift it). Lists dropped
 * below the floor free their memory and mark the group as holding untracked nonzeros. A
 * selection that finds fewer than k tracked while untracked nonzeros exist refills the
 * group by a full pass over its R (a histogram of buckets, the floor set from it as
 * above, the lists rebuilt; counted in full_passes); one that finds fewer than k and none
 * untracked takes them all (the group is then all zero, and its floor goes back to 1).
 * In a steady run the k-th largest stays above the floor and no full pass happens; with
 * k and the changes' scale noisy (x0.5-1.5 and x0.7-1.3 from step to step, on 1M
 * coordinates at bench.residual's densities) at most one in 300 steps; a residual whose
 * magnitudes fall steadily costs one every third of an octave or so (changes halving
 * every 100 steps: 9-10 passes in 300 steps at 8-32% touched, none at 2%).
 * Why a reserve of 4k and not a margin of octaves: the tracked coordinates cost list
 * work on every add that moves them. A floor one octave down tracked 20-35% of the
 * coordinates in bench.residual's runs and cost 2-2.3x more per touched coordinate than
 * a reserve of 8k (6-18% tracked); with the coding error added back after each selection
 * (R never empties), a reserve of 4k made a step 10-25% cheaper than 8k for one more
 * full pass in a decay that halves the changes every 20 steps. A full pass costs about
 * two steps of the streaming top-k.
 *
 * Memory, per coordinate of the sparse range: R's 4 bytes (the caller's array) and
 * nothing else per coordinate; per *tracked* coordinate one 4-byte list entry, up to
 * about 12 bytes with stale entries and list capacity; 16 bytes of work space per
 * selected coordinate and per boundary entry, kept between calls; 2 KiB per 4 octaves of
 * buckets in use and ~600 bytes per group. bench.residual prints the total per
 * coordinate (R included): 4.0-5.6 bytes in its runs, 3-10% of the coordinates tracked.
 *
 * Adds to the dense suffix [sparse_numel, numel) only change R. Every result depends
 * only on the sequence of calls (no randomness, no threads): the same calls give the
 * same bits, whatever the index held before (a selection is the exact top k).
 */
#include <stdlib.h>
#include <string.h>

#include "stella_native.h"

#include "cdefs/residual.h"

#define RB_SHIFT 19                              /* 23 - 4 mantissa bits */
#define RB_PER_OCTAVE (1 << (23 - RB_SHIFT))     /* 16 */
#define RB_BUCKETS 4096                          /* bucket(+inf) = 4081 */
#define RB_CHUNK 64                              /* buckets per table chunk (4 octaves) */
#define RB_CHUNKS (RB_BUCKETS / RB_CHUNK)
#define MARGIN 2                                 /* the floor's distance below the k-th largest */
#define RESERVE 4                                /* ... and at least this many times k tracked */
#define RAISE_AFTER 4                            /* the floor rises to the lowest of this many candidates */
#define COMPACT_RATIO 2                          /* a list is compacted when its entries pass this many */
#define COMPACT_SLACK 64                         /* times its valid ones, and this many more */
#define PF_AHEAD 32                              /* coordinates ahead to prefetch R at (64, 96, 192: no faster) */
#define MOVE_BATCH 1024                          /* entries an add takes at a time */
#define SMALL_SORT 64                            /* fewer pairs than this: insertion sort */
#define DIGIT_MAX 11                             /* the radix select's digits: 2048 bins */
#define SORT_DIGIT 12                            /* the radix sort's digits: up to 4096 bins */

_Static_assert((0x7f800000u >> RB_SHIFT) + 1 < RB_BUCKETS, "every finite and infinite |R| has a bucket");

static inline int32_t bucket_of(float x) {
    const uint32_t key = stella_f32_bits(x) & 0x7fffffffu;
    return key ? (int32_t)(key >> RB_SHIFT) + 1 : 0;
}

/* A boundary candidate's key: larger for larger |x|, then for the lower index. */
static inline uint64_t rank_key(int32_t c, float x) {
    return (uint64_t)(stella_f32_bits(x) & 0x7fffffffu) << 32 | (uint32_t)(INT32_MAX - c);
}

typedef struct {
    int32_t *idx;
    int64_t len, cap; /* entries (stale ones included), room */
    int64_t count;    /* coordinates whose bucket this is */
} rlist;

typedef struct {
    int32_t c;
    float v;
} rpair;

typedef struct { /* a coordinate whose bucket an add changed */
    int32_t c;
    int16_t bo, bn;
} rmove;

typedef struct {
    int64_t lo, hi;  /* the group's coordinates [lo, hi) */
    int64_t tracked; /* the sum of its lists' counts */
    int32_t floor;   /* lowest tracked bucket (>= 1) */
    int32_t top;     /* no bucket above it holds a tracked coordinate */
    int32_t stale;   /* the lists are not kept: rebuild before the next selection */
    int32_t untracked; /* a nonzero may sit below the floor */
    int32_t ncand;
    int32_t cand[RAISE_AFTER]; /* the last selections' candidate floors, newest last */
    rlist *chunk[RB_CHUNKS]; /* RB_CHUNK buckets each, allocated when first used */
} rgroup;

struct stella_residual {
    float *r;
    int64_t numel, sparse;
    int32_t ngroups;
    rgroup *g;
    int64_t full_passes;
    int64_t list_bytes, meta_bytes;
    void *work; /* selection and compaction work space, kept between calls */
    int64_t work_bytes;
};

/* ---- lists ------------------------------------------------------------------ */

static inline rlist *list_at(const rgroup *g, int32_t b) {
    rlist *ch = g->chunk[b / RB_CHUNK];
    return ch ? ch + b % RB_CHUNK : NULL;
}

static rlist *list_make(stella_residual *st, rgroup *g, int32_t b) {
    rlist **ch = &g->chunk[b / RB_CHUNK];
    if (STELLA_UNLIKELY(!*ch)) {
        *ch = (rlist *)calloc(RB_CHUNK, sizeof(rlist));
        if (!*ch) return NULL;
        st->meta_bytes += RB_CHUNK * (int64_t)sizeof(rlist);
    }
    return *ch + b % RB_CHUNK;
}

static int list_resize(stella_residual *st, rlist *l, int64_t cap) {
    int32_t *p = (int32_t *)realloc(l->idx, (size_t)(cap > 0 ? cap : 1) * sizeof(int32_t));
    if (!p) return STELLA_E_NOMEM;
    st->list_bytes += (cap - l->cap) * (int64_t)sizeof(int32_t);
    l->idx = p;
    l->cap = cap;
    return STELLA_OK;
}

static inline int list_push(stella_residual *st, rlist *l, int32_t c) {
    if (STELLA_UNLIKELY(l->len == l->cap)) {
        const int rc = list_resize(st, l, l->cap + l->cap / 2 + 16);
        if (rc != STELLA_OK) return rc;
    }
    l->idx[l->len++] = c;
    return STELLA_OK;
}

static void list_drop(stella_residual *st, rlist *l) {
    free(l->idx);
    st->list_bytes -= l->cap * (int64_t)sizeof(int32_t);
    memset(l, 0, sizeof *l);
}

static void group_drop_below(stella_residual *st, rgroup *g, int32_t f) {
    for (int32_t ch = 0; ch < RB_CHUNKS && ch * RB_CHUNK < f; ch++) {
        if (!g->chunk[ch]) continue;
        for (int32_t b = ch * RB_CHUNK; b < (ch + 1) * RB_CHUNK && b < f; b++) {
            rlist *l = g->chunk[ch] + b % RB_CHUNK;
            if (l->count > 0) {
                g->untracked = 1;
                g->tracked -= l->count;
            }
            if (l->cap) list_drop(st, l);
        }
        if ((ch + 1) * RB_CHUNK <= f) {
            free(g->chunk[ch]);
            g->chunk[ch] = NULL;
            st->meta_bytes -= RB_CHUNK * (int64_t)sizeof(rlist);
        }
    }
}

/* Room for `bytes` of work space (its contents are not kept). */
static void *work(stella_residual *st, int64_t bytes) {
    if (bytes <= st->work_bytes) return st->work;
    const int64_t want = bytes + bytes / 2;
    void *p = malloc((size_t)want);
    if (!p) return NULL;
    free(st->work);
    st->work = p;
    st->work_bytes = want;
    return p;
}

/* Of the m valid entries cand[0..m) (a coordinate may be there twice: listed twice in
 * its bucket), keep the first of each; returns how many remain. R is set to 0 at each
 * kept one as it goes (a second entry then reads 0), then put back. */
static int64_t dedup(float *r, rpair *cand, int64_t m) {
    int64_t kept = 0;
    for (int64_t j = 0; j < m; j++) {
        const int32_t c = cand[j].c;
        cand[kept] = cand[j];
        kept += r[c] != 0.0f;
        r[c] = 0.0f;
    }
    for (int64_t j = 0; j < kept; j++) r[cand[j].c] = cand[j].v;
    return kept;
}

/* Drop list b's stale entries (and duplicates: rare, looked for only when the valid
 * entries outnumber the count). */
static int list_compact(stella_residual *st, rlist *l, int32_t b) {
    float *r = st->r;
    int64_t m = 0;
    for (int64_t j = 0; j < l->len; j++) {
        if (j + PF_AHEAD < l->len) __builtin_prefetch(r + l->idx[j + PF_AHEAD], 0, 0);
        const int32_t c = l->idx[j];
        l->idx[m] = c;
        m += bucket_of(r[c]) == b;
    }
    if (m > l->count) {
        rpair *cand = (rpair *)work(st, m * (int64_t)sizeof(rpair));
        if (!cand) return STELLA_E_NOMEM;
        for (int64_t j = 0; j < m; j++) {
            cand[j].c = l->idx[j];
            cand[j].v = r[l->idx[j]];
        }
        m = dedup(r, cand, m);
        for (int64_t j = 0; j < m; j++) l->idx[j] = cand[j].c;
    }
    l->len = m;
    if (l->cap > 8 * m + 4096) list_resize(st, l, 4 * m + 1024); /* a failed shrink keeps the list as it is */
    return STELLA_OK;
}

/* ---- life cycle ------------------------------------------------------------- */

stella_residual *stella_residual_new(float *r, int64_t numel, int64_t sparse_numel, const int64_t *bounds,
                                     int32_t ngroups) {
    if ((numel > 0 && !r) || numel < 0 || numel > INT32_MAX || sparse_numel < 0 || sparse_numel > numel ||
        ngroups < 0 || (ngroups > 0 && !bounds) || (ngroups == 0) != (sparse_numel == 0))
        return NULL;
    if (ngroups > 0) {
        if (bounds[0] != 0 || bounds[ngroups] != sparse_numel) return NULL;
        for (int32_t i = 0; i < ngroups; i++)
            if (bounds[i + 1] <= bounds[i]) return NULL;
    }
    stella_residual *st = (stella_residual *)calloc(1, sizeof *st);
    if (!st) return NULL;
    st->g = (rgroup *)calloc((size_t)(ngroups > 0 ? ngroups : 1), sizeof(rgroup));
    if (!st->g) {
        free(st);
        return NULL;
    }
    st->r = r;
    st->numel = numel;
    st->sparse = sparse_numel;
    st->ngroups = ngroups;
    for (int32_t i = 0; i < ngroups; i++) {
        st->g[i].lo = bounds[i];
        st->g[i].hi = bounds[i + 1];
        st->g[i].floor = 1; /* R is zero: nothing is untracked */
    }
    return st;
}

void stella_residual_free(stella_residual *st) {
    if (!st) return;
    for (int32_t i = 0; i < st->ngroups; i++) {
        group_drop_below(st, &st->g[i], RB_BUCKETS);
    }
    free(st->g);
    free(st->work);
    free(st);
}

void stella_residual_invalidate(stella_residual *st) {
    for (int32_t i = 0; i < st->ngroups; i++) st->g[i].stale = 1;
}

void stella_residual_stats_get(const stella_residual *st, stella_residual_stats *out) {
    memset(out, 0, sizeof *out);
    out->full_passes = st->full_passes;
    out->bytes = st->list_bytes + st->meta_bytes + st->work_bytes + (int64_t)sizeof *st +
                 (int64_t)sizeof(rgroup) * st->ngroups;
    for (int32_t i = 0; i < st->ngroups; i++) {
        const rgroup *g = &st->g[i];
        out->stale += g->stale != 0;
        if (g->stale) continue;
        out->tracked += g->tracked;
        for (int32_t ch = 0; ch < RB_CHUNKS; ch++)
            if (g->chunk[ch])
                for (int32_t j = 0; j < RB_CHUNK; j++) out->entries += g->chunk[ch][j].len;
    }
}

/* ---- add ---------------------------------------------------------------------- */

static int32_t group_of(const stella_residual *st, int64_t c) {
    int32_t lo = 0, hi = st->ngroups - 1;
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo) / 2;
        if (st->g[mid].hi <= c)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The lists' side of a batch of moves (coordinates whose bucket changed at or above the
 * floor): counts, appends, compactions. */
static void apply_moves(stella_residual *st, rgroup *g, int32_t floor, const rmove *mv, int64_t m) {
    for (int64_t j = 0; j < m; j++) {
        const int32_t c = mv[j].c, bo = mv[j].bo, bn = mv[j].bn;
        if (bo >= floor) {
            rlist *l = list_at(g, bo);
            l->count--;
            g->tracked--;
            if (l->len > COMPACT_RATIO * l->count + COMPACT_SLACK && list_compact(st, l, bo) != STELLA_OK) {
                g->stale = 1; /* out of memory: the next selection rebuilds the group */
                return;
            }
        }
        if (bn >= floor) {
            rlist *l = list_make(st, g, bn);
            if (!l || list_push(st, l, c) != STELLA_OK) {
                g->stale = 1;
                return;
            }
            l->count++;
            g->tracked++;
            if (bn > g->top) g->top = bn;
        }
    }
}

/* One coordinate's change, noted as a move (kept: m += 1) when its bucket changed at or
 * above the floor, without a branch. */
#define NOTE_MOVE(c, old, x)                                                    \
    do {                                                                        \
        const int32_t bo_ = bucket_of(old), bn_ = bucket_of(x);                 \
        mv[m].c = (c);                                                          \
        mv[m].bo = (int16_t)bo_;                                                \
        mv[m].bn = (int16_t)bn_;                                                \
        m += (bo_ != bn_) & ((bo_ > bn_ ? bo_ : bn_) >= floor);                 \
        below |= (bn_ > 0) & (bn_ < floor);                                     \
    } while (0)

int stella_residual_add_lists(stella_residual *st, const stella_sparse_list *lists, int32_t nlists, int32_t *bad,
                              int64_t *where) {
    if (!st || nlists < 0 || nlists > STELLA_RESIDUAL_MAX_LISTS || (nlists > 0 && !lists)) return STELLA_E_ARG;
    for (int32_t l = 0; l < nlists; l++) {
        if (bad) *bad = l;
        const int32_t *idx = lists[l].idx;
        const float *val = lists[l].val;
        const int64_t n = lists[l].n;
        if (n < 0 || (n > 0 && (!idx || !val))) return STELLA_E_ARG;
        const int rc = stella_check_sorted(idx, n, st->numel, where);
        if (rc != STELLA_OK) return rc;
        for (int64_t i = 0; i < n; i++)
            if (STELLA_UNLIKELY((stella_f32_bits(val[i]) & 0x7f800000u) == 0x7f800000u)) {
                if (where) *where = i;
                return STELLA_E_NONFINITE;
            }
    }
    /* Batches of one group's coordinates: first the adds (R read and written once per
     * coordinate, the lists' values added in list order; the moves noted), then the
     * lists. */
    float *r = st->r;
    rmove mv[MOVE_BATCH];
    int64_t cur[STELLA_RESIDUAL_MAX_LISTS], ns[STELLA_RESIDUAL_MAX_LISTS];
    int32_t gi = 0, first = INT32_MAX;
    for (int32_t l = 0; l < nlists; l++) {
        cur[l] = 0;
        ns[l] = stella_lower_bound(lists[l].idx, lists[l].n, st->sparse); /* the entries in the indexed range */
        if (ns[l] > 0 && lists[l].idx[0] < first) first = lists[l].idx[0];
    }
    if (first != INT32_MAX) gi = group_of(st, first);
    for (;;) {
        int32_t c0 = INT32_MAX; /* the batch's first coordinate */
        for (int32_t l = 0; l < nlists; l++)
            if (cur[l] < ns[l] && lists[l].idx[cur[l]] < c0) c0 = lists[l].idx[cur[l]];
        if (c0 == INT32_MAX) break;
        while (c0 >= st->g[gi].hi) gi++;
        rgroup *g = &st->g[gi];
        const int32_t floor = g->stale ? INT32_MAX : g->floor, hi = (int32_t)(g->hi < INT32_MAX ? g->hi : INT32_MAX);
        int64_t m = 0;
        int32_t below = 0;
        if (nlists == 1) { /* one list: no merge */
            const int32_t *idx = lists[0].idx;
            const float *val = lists[0].val;
            const int64_t n = lists[0].n, end = cur[0] + MOVE_BATCH < ns[0] ? cur[0] + MOVE_BATCH : ns[0];
            int64_t i = cur[0];
            for (; i < end && idx[i] < hi; i++) {
                if (i + PF_AHEAD < n) __builtin_prefetch(r + idx[i + PF_AHEAD], 1, 0);
                const int32_t c = idx[i];
                const float old = r[c], x = old + val[i];
                r[c] = x;
                NOTE_MOVE(c, old, x);
            }
            cur[0] = i;
        } else {
            for (int64_t b = 0; b < MOVE_BATCH; b++) {
                int32_t c = INT32_MAX;
                for (int32_t l = 0; l < nlists; l++)
                    if (cur[l] < ns[l] && lists[l].idx[cur[l]] < c) c = lists[l].idx[cur[l]];
                if (c >= hi) break; /* (INT32_MAX: every list is done) */
                const float old = r[c];
                float x = old;
                for (int32_t l = 0; l < nlists; l++) {
                    const int64_t i = cur[l];
                    if (i < ns[l] && lists[l].idx[i] == c) {
                        if (i + PF_AHEAD < lists[l].n) __builtin_prefetch(r + lists[l].idx[i + PF_AHEAD], 1, 0);
                        x += lists[l].val[i];
                        cur[l] = i + 1;
                    }
                }
                r[c] = x;
                NOTE_MOVE(c, old, x);
            }
        }
        if (g->stale) continue;
        g->untracked |= below;
        apply_moves(st, g, floor, mv, m);
    }
    /* The dense suffix: list after list (a coordinate gets its values in list order). */
    for (int32_t l = 0; l < nlists; l++)
        for (int64_t i = ns[l]; i < lists[l].n; i++) r[lists[l].idx[i]] += lists[l].val[i];
    return STELLA_OK;
}

int stella_residual_add(stella_residual *st, const int32_t *idx, const float *val, int64_t n, int64_t *where) {
    if (!st) return STELLA_E_ARG;
    const stella_sparse_list one = {idx, val, n};
    return stella_residual_add_lists(st, &one, 1, NULL, where);
}

/* ---- full pass ---------------------------------------------------------------- */

/* Rebuild group g's lists from its R, with the floor set for a selection of k. */
static int rebuild(stella_residual *st, rgroup *g, int64_t k) {
    g->stale = 1; /* until done: a failure leaves it to the next selection */
    int64_t *hist = (int64_t *)calloc(RB_BUCKETS, sizeof(int64_t));
    if (!hist) return STELLA_E_NOMEM;
    const float *r = st->r;
    for (int64_t c = g->lo; c < g->hi; c++) hist[bucket_of(r[c])]++;
    int32_t bk = 1, bres = 1;
    int64_t cum = 0;
    for (int32_t b = RB_BUCKETS - 1; b >= 1; b--) {
        cum += hist[b];
        if (cum >= k && bk == 1) bk = b;
        if (cum >= RESERVE * k) {
            bres = b;
            break;
        }
    }
    int32_t f = bk - MARGIN < bres ? bk - MARGIN : bres;
    if (f < 1) f = 1;
    group_drop_below(st, g, f);
    int rc = STELLA_OK;
    int64_t tracked = 0;
    int32_t top = 0;
    for (int32_t b = f; b < RB_BUCKETS && rc == STELLA_OK; b++) {
        rlist *l = hist[b] > 0 ? list_make(st, g, b) : list_at(g, b);
        if (!l) {
            rc = hist[b] > 0 ? STELLA_E_NOMEM : STELLA_OK;
            continue;
        }
        if (l->cap < hist[b]) rc = list_resize(st, l, hist[b]);
        l->len = 0;
        l->count = hist[b];
        tracked += hist[b];
        if (hist[b] > 0) top = b;
    }
    int untracked = 0;
    for (int32_t b = 1; b < f; b++) untracked |= hist[b] > 0;
    free(hist);
    if (rc != STELLA_OK) return rc;
    for (int64_t c = g->lo; c < g->hi; c++) {
        const int32_t b = bucket_of(r[c]);
        if (b >= f) {
            rlist *l = list_at(g, b);
            l->idx[l->len++] = (int32_t)c;
        }
    }
    g->floor = f;
    g->top = top;
    g->tracked = tracked;
    g->untracked = untracked;
    g->ncand = 0;
    g->stale = 0;
    st->full_passes++;
    return STELLA_OK;
}

/* ---- selection ---------------------------------------------------------------- */

/* The rank-th largest (1 <= rank <= m) of m distinct keys (reordered). */
static uint64_t kth_largest(uint64_t *keys, int64_t m, int64_t rank) {
    uint32_t cnt[1 << DIGIT_MAX];
    const uint32_t mask = (1u << DIGIT_MAX) - 1;
    int64_t n = m;
    for (int shift = 64 - DIGIT_MAX;; shift -= DIGIT_MAX) {
        const int sh = shift > 0 ? shift : 0;
        memset(cnt, 0, sizeof cnt);
        for (int64_t i = 0; i < n; i++) cnt[(keys[i] >> sh) & mask]++;
        uint32_t d = mask;
        while ((int64_t)cnt[d] < rank) rank -= cnt[d--];
        int64_t j = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint64_t key = keys[i];
            keys[j] = key;
            j += ((key >> sh) & mask) == d;
        }
        n = j;
        if (n == 1 || sh == 0) return keys[0];
    }
}

/* Pairs sorted by index (their indices in [lo, lo + span)); the result is in a or tmp.
 * LSD radix, digits of at most SORT_DIGIT bits, every digit's histogram taken in one
 * read first; a digit that all pairs share costs no pass. */
static rpair *sort_pairs(rpair *a, rpair *tmp, int64_t n, int64_t lo, int64_t span) {
    if (n < SMALL_SORT) {
        for (int64_t i = 1; i < n; i++) {
            const rpair p = a[i];
            int64_t j = i;
            for (; j > 0 && a[j - 1].c > p.c; j--) a[j] = a[j - 1];
            a[j] = p;
        }
        return a;
    }
    int bits = 1;
    while ((INT64_C(1) << bits) < span) bits++;
    const int passes = (bits + SORT_DIGIT - 1) / SORT_DIGIT, digit = (bits + passes - 1) / passes;
    const uint32_t mask = (1u << digit) - 1;
    static _Thread_local int64_t pos[(32 + SORT_DIGIT - 1) / SORT_DIGIT][1 << SORT_DIGIT];
    memset(pos, 0, sizeof(pos[0]) * (size_t)passes);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t key = (uint32_t)(a[i].c - lo);
        for (int p = 0; p < passes; p++) pos[p][(key >> (p * digit)) & mask]++;
    }
    for (int p = 0; p < passes; p++) {
        int64_t *at = pos[p];
        if (at[((uint32_t)(a[0].c - lo) >> (p * digit)) & mask] == n) continue; /* one bin: already in order */
        int64_t sum = 0;
        for (uint32_t d = 0; d <= mask; d++) {
            const int64_t cnt = at[d];
            at[d] = sum;
            sum += cnt;
        }
        const int shift = p * digit;
        for (int64_t i = 0; i < n; i++) tmp[at[((uint32_t)(a[i].c - lo) >> shift) & mask]++] = a[i];
        rpair *t = a;
        a = tmp;
        tmp = t;
    }
    return a;
}

/* The highest bucket at or below `from` whose chunk exists, or floor - 1. */
static inline int32_t next_bucket(const rgroup *g, int32_t from) {
    int32_t b = from;
    while (b >= g->floor && !g->chunk[b / RB_CHUNK]) b = b - b % RB_CHUNK - 1;
    return b;
}

/* The entries of the boundary bucket when `want` are taken from group g (0: none). */
static int64_t boundary_len(const rgroup *g, int64_t want) {
    int64_t rem = want;
    for (int32_t b = next_bucket(g, g->top); rem > 0 && b >= g->floor; b = next_bucket(g, b - 1)) {
        const rlist *l = list_at(g, b);
        if (l->count == 0) continue;
        if (l->count > rem) return l->len;
        rem -= l->count;
    }
    return 0;
}

/* After a selection of k from g whose lowest bucket was `last`: the floor's next candidate. */
static void floor_policy(stella_residual *st, rgroup *g, int64_t k, int32_t last) {
    if (g->tracked == 0 && !g->untracked) { /* all zero: any floor holds everything (the lists,
                                                * empty of valid entries, are kept for reuse) */
        g->floor = 1;
        g->top = 0;
        g->ncand = 0;
        return;
    }
    int32_t bres = g->floor;
    int64_t cum = 0;
    for (int32_t b = next_bucket(g, g->top); b >= g->floor; b = next_bucket(g, b - 1)) {
        cum += list_at(g, b)->count;
        if (cum >= RESERVE * k) {
            bres = b;
            break;
        }
    }
    const int32_t cand = last - MARGIN < bres ? last - MARGIN : bres;
    if (g->ncand == RAISE_AFTER) {
        memmove(g->cand, g->cand + 1, (RAISE_AFTER - 1) * sizeof(int32_t));
        g->ncand--;
    }
    g->cand[g->ncand++] = cand;
    if (g->ncand < RAISE_AFTER) return;
    int32_t f = cand;
    for (int i = 0; i < RAISE_AFTER; i++) f = g->cand[i] < f ? g->cand[i] : f;
    if (f > g->floor) {
        group_drop_below(st, g, f);
        g->floor = f;
    }
}

/* Take the top `k` of group g into oi/ov (sorted); w: work space for the plan's size. */
static int64_t select_group(stella_residual *st, rgroup *g, int64_t k, void *w, int32_t *oi, float *ov) {
    float *r = st->r;
    const int64_t want = k < g->tracked ? k : g->tracked; /* fewer only when none is untracked */
    const int64_t blen = boundary_len(g, want);
    rpair *sel = (rpair *)w, *tmp = sel + want, *cand = tmp + want;
    uint64_t *keys = (uint64_t *)(cand + blen);
    int64_t n = 0, rem = want;
    int32_t last = g->top;
    for (int32_t b = next_bucket(g, g->top); rem > 0 && b >= g->floor; b = next_bucket(g, b - 1)) {
        rlist *l = list_at(g, b);
        if (l->count == 0) continue;
        last = b;
        const int64_t len = l->len;
        const int32_t *li = l->idx;
        if (l->count <= rem) { /* the whole bucket */
            for (int64_t j = 0; j < len; j++) {
                if (j + PF_AHEAD < len) __builtin_prefetch(r + li[j + PF_AHEAD], 1, 0);
                const int32_t c = li[j];
                const float x = r[c];
                if (bucket_of(x) == b) {
                    sel[n].c = c;
                    sel[n++].v = x;
                    r[c] = 0.0f;
                }
            }
            rem -= l->count;
            g->tracked -= l->count;
            l->count = l->len = 0;
            continue;
        }
        int64_t m = 0; /* the boundary: its valid entries (a coordinate listed twice deduplicated) */
        for (int64_t j = 0; j < len; j++) {
            if (j + PF_AHEAD < len) __builtin_prefetch(r + li[j + PF_AHEAD], 0, 0);
            const int32_t c = li[j];
            const float x = r[c];
            cand[m].c = c;
            cand[m].v = x;
            m += bucket_of(x) == b;
        }
        if (m > l->count) m = dedup(r, cand, m);
        for (int64_t j = 0; j < m; j++) keys[j] = rank_key(cand[j].c, cand[j].v);
        const uint64_t cut = rem < m ? kth_largest(keys, m, rem) : 0; /* (m > rem: the count says so) */
        int64_t kept = 0;
        for (int64_t j = 0; j < m; j++) {
            if (rank_key(cand[j].c, cand[j].v) >= cut) {
                r[cand[j].c] = 0.0f;
                sel[n++] = cand[j];
            } else {
                l->idx[kept++] = cand[j].c;
            }
        }
        g->tracked -= l->count - kept;
        l->len = l->count = kept;
        rem = 0;
    }
    g->top = last;
    const rpair *out = sort_pairs(sel, tmp, n, g->lo, g->hi - g->lo);
    for (int64_t j = 0; j < n; j++) {
        oi[j] = out[j].c;
        ov[j] = out[j].v;
    }
    floor_policy(st, g, k, last);
    return n;
}

int64_t stella_residual_select(stella_residual *st, const int64_t *k, int32_t ngroups, int32_t *out_idx,
                               float *out_val, int64_t cap) {
    if (!st || ngroups != st->ngroups || (ngroups > 0 && !k) || cap < 0) return STELLA_E_ARG;
    int64_t total = 0;
    for (int32_t i = 0; i < ngroups; i++) {
        if (k[i] < 0 || k[i] > st->g[i].hi - st->g[i].lo) return STELLA_E_ARG;
        total += k[i];
    }
    if (total > cap || (total > 0 && (!out_idx || !out_val))) return STELLA_E_ARG;
    /* Refill first (nothing in R changes there), then size the work space: a failure
     * leaves R as it was. */
    int64_t need = 0;
    for (int32_t i = 0; i < ngroups; i++) {
        rgroup *g = &st->g[i];
        if (k[i] == 0) continue;
        if (g->stale || (g->tracked < k[i] && g->untracked)) {
            const int rc = rebuild(st, g, k[i]);
            if (rc != STELLA_OK) return rc;
        }
        const int64_t want = k[i] < g->tracked ? k[i] : g->tracked;
        const int64_t bytes = 2 * want * (int64_t)sizeof(rpair) +
                              boundary_len(g, want) * (int64_t)(sizeof(rpair) + sizeof(uint64_t));
        need = bytes > need ? bytes : need;
    }
    void *w = work(st, need);
    if (need > 0 && !w) return STELLA_E_NOMEM;
    int64_t n = 0;
    for (int32_t i = 0; i < ngroups; i++)
        if (k[i] > 0) n += select_group(st, &st->g[i], k[i], w, out_idx + n, out_val + n);
    return n;
}

/* ---- tests ---------------------------------------------------------------------- */

int stella_residual_verify(const stella_residual *st) {
    int rc = STELLA_OK;
    for (int32_t i = 0; i < st->ngroups && rc == STELLA_OK; i++) {
        const rgroup *g = &st->g[i];
        if (g->stale) continue;
        const int64_t size = g->hi - g->lo;
        uint8_t *seen = (uint8_t *)calloc((size_t)size, 1);
        if (!seen) return STELLA_E_NOMEM;
        int64_t tracked = 0;
        if (g->floor < 1) rc = STELLA_E_CORRUPT;
        for (int32_t b = 1; b < RB_BUCKETS && rc == STELLA_OK; b++) {
            const rlist *l = list_at(g, b);
            if (!l) continue;
            if (b < g->floor) {
                if (l->len || l->count) rc = STELLA_E_CORRUPT;
                continue;
            }
            int64_t valid = 0;
            for (int64_t j = 0; j < l->len; j++) {
                const int64_t c = l->idx[j];
                if (c < g->lo || c >= g->hi) {
                    rc = STELLA_E_CORRUPT;
                    break;
                }
                if (bucket_of(st->r[c]) == b && !seen[c - g->lo]) {
                    seen[c - g->lo] = 1;
                    valid++;
                }
            }
            if (valid != l->count || (l->count > 0 && b > g->top)) rc = STELLA_E_CORRUPT;
            tracked += valid;
        }
        if (tracked != g->tracked) rc = STELLA_E_CORRUPT;
        for (int64_t c = g->lo; c < g->hi && rc == STELLA_OK; c++) {
            const int32_t b = bucket_of(st->r[c]);
            if ((b >= g->floor && !seen[c - g->lo]) || (b > 0 && b < g->floor && !g->untracked))
                rc = STELLA_E_CORRUPT;
        }
        free(seen);
    }
    return rc;
}
