/* residual.c: the broadcast's flat residual R with an index of its largest magnitudes,
 * kept current as R changes, so that a step's top-k costs what the step touched and
 * selected, not the size of R. R is the caller's float32 array (numel coordinates); the
 * index covers [0, sparse_numel), cut into groups (contiguous ranges, each with its own
 * quota at a selection); the dense suffix [sparse_numel, numel) is only added to.
 * Design and costs: the header comment of native/residual.c. Not thread-safe: one call
 * at a time on one residual. */
typedef struct stella_residual stella_residual;

/* Counters of one residual (stella_residual_stats). */
typedef struct {
    int64_t full_passes; /* passes of a group's index over all of the group's R (refill, rebuild) */
    int64_t bytes;       /* bytes held in C: index lists, bucket tables, work space (not R) */
    int64_t tracked;     /* coordinates in the index (|R| at or above their group's floor) */
    int64_t entries;     /* list entries, the stale ones included */
    int64_t stale;       /* groups whose index waits for a rebuild (after a load, or memory ran out) */
} stella_residual_stats;

/* A residual over r[0..numel) (zeros: the caller's array, kept by the caller while the
 * residual lives), groups cut at bounds[0] = 0 < bounds[1] < ... < bounds[ngroups] =
 * sparse_numel (ngroups 0 when sparse_numel is 0). NULL on bad arguments or no memory. */
stella_residual *stella_residual_new(float *r, int64_t numel, int64_t sparse_numel, const int64_t *bounds,
                                     int32_t ngroups);
void stella_residual_free(stella_residual *st);
/* r[idx[j]] += val[j] in order (idx sorted, unique, in [0, numel); val finite, all checked
 * first: STELLA_E_RANGE / STELLA_E_ORDER / STELLA_E_NONFINITE with the first bad position
 * in *where, and nothing changed). */
int stella_residual_add(stella_residual *st, const int32_t *idx, const float *val, int64_t n, int64_t *where);
/* The most lists one stella_residual_add_lists call takes. */
#define STELLA_RESIDUAL_MAX_LISTS 4
/* r[lists[l].idx[j]] += lists[l].val[j] for each list l < nlists in turn, in one sweep (R
 * read and written once per coordinate, its values added in list order: the same floats
 * as one stella_residual_add per list); each list checked as stella_residual_add's, the
 * first bad one's number in *bad and position in *where. */
int stella_residual_add_lists(stella_residual *st, const stella_sparse_list *lists, int32_t nlists, int32_t *bad,
                              int64_t *where);
/* For each group g: the k[g] coordinates of largest |r| in it (all its nonzeros when
 * fewer; ties: the lower index first), r set to +0 there; out_idx/out_val (room for cap >=
 * the sum of k) get them sorted by index, with the values r held. Returns the count, or
 * STELLA_E_ARG (ngroups, a k outside [0, group size], cap) / STELLA_E_NOMEM, nothing
 * changed. */
int64_t stella_residual_select(stella_residual *st, const int64_t *k, int32_t ngroups, int32_t *out_idx,
                               float *out_val, int64_t cap);
/* r was overwritten by the caller (a checkpoint's residual): every group's index is
 * rebuilt at its next selection. */
void stella_residual_invalidate(stella_residual *st);
void stella_residual_stats_get(const stella_residual *st, stella_residual_stats *out);
/* Tests: STELLA_OK when every group's index matches r (each coordinate at or above its
 * floor listed in its bucket, the counts and flags right), else STELLA_E_CORRUPT;
 * STELLA_E_NOMEM. O(numel). */
int stella_residual_verify(const stella_residual *st);
