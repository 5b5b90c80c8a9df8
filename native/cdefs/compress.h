/* compress.c: error feedback fused with top-k selection (sampled threshold, block). */
#define STELLA_BLOCK 16 /* floats per block of the "block" method (one 64-byte line) */

/* Carried by the caller per tensor across steps; all zeros at first. */
typedef struct {
    float emit_threshold; /* threshold to emit candidates at (<= 0: estimate from a sample) */
    float last_threshold; /* last step's selection threshold (for the drift correction) */
    float zero_threshold; /* threshold to zero at, aimed at k (<= emit: same as emit) */
} stella_topk_state;

/* What one call asks for. */
typedef struct {
    int64_t k_units; /* wanted units: elements (unit 1) or blocks (unit STELLA_BLOCK) */
    int32_t unit;    /* 1 ("threshold") or STELLA_BLOCK ("block") */
    int64_t nsample; /* floats (unit 1) or blocks (unit STELLA_BLOCK) to sample */
    uint64_t seed;
    int32_t threads; /* unit 1's pass over the residual on up to this many threads (0 or 1: this one) */
} stella_topk_args;

/* Where the selection goes: room for cap_units * unit indices and values (sorted
 * indices); score holds cap_units block scores (unit STELLA_BLOCK, else unused).
 * stella_topk_cap_units gives the room a call should have. */
typedef struct {
    int32_t *idx;
    float *val;
    float *score;
    int64_t cap_units;
} stella_topk_out;

/* Counters of one call (benchmarks and tests). */
typedef struct {
    int64_t passes;         /* streaming passes over the tensor */
    int64_t estimates;      /* threshold estimates from a sample */
    int64_t trims;          /* final cuts that dropped candidates */
    int64_t givebacks;      /* passes undone (too many or too few candidates) */
    int64_t units;          /* units selected */
    int64_t exact_fallback; /* 1 when the exact radix select gave the threshold */
} stella_topk_stats;

/* res += grad (grad may be NULL), select ~k_units, zero them in res. Returns the
 * number of elements written to out (sorted indices) or a STELLA_E_* code; stats
 * may be NULL. */
int64_t stella_ef_topk(float *res, const float *grad, int64_t n, const stella_topk_args *args,
                       stella_topk_state *state, const stella_topk_out *out, stella_topk_stats *stats);
/* Sparse changes (stella_sparse_list, cdefs/core.h) one stella_ef_topk_add call adds. */
#define STELLA_TOPK_MAX_ADDS 4

/* res[adds[l].idx[j]] += adds[l].val[j] for each list l < nadds (at most
 * STELLA_TOPK_MAX_ADDS) in order, then stella_ef_topk(res, NULL, ...): the same result bit
 * for bit, the lists added tile by tile in the first pass. unit 1 only. */
int64_t stella_ef_topk_add(float *res, int64_t n, const stella_sparse_list *adds, int32_t nadds,
                           const stella_topk_args *args, stella_topk_state *state, const stella_topk_out *out,
                           stella_topk_stats *stats);
float stella_kth_largest_abs(const float *v, int64_t n, int64_t k);
/* The cap_units for a selection of k_units out of `units` (floats, or blocks for unit
 * STELLA_BLOCK): what a pass at a carried threshold may draw, with some to spare; a pass
 * that draws more gives them back and runs again. */
int64_t stella_topk_cap_units(int64_t k_units, int64_t units);
