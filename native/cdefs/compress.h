/* compress.c: error feedback fused with top-k selection (sampled threshold, block). */
int64_t stella_ef_topk(float *res, const float *grad, int64_t n, int64_t k_units,
                       int32_t unit, float *state, int64_t nsample, uint64_t seed,
                       int32_t *idx, float *val, float *score, int64_t cap_units,
                       int64_t *stats);
float stella_kth_largest_abs(const float *v, int64_t n, int64_t k);
