/* Roofline probe for bench/kernel.py: the cheapest possible random read-modify-write
 * of one float per cache line at sorted positions, software-prefetched. No optimizer
 * can update random coordinates faster than this loop touches their lines. */
#include "../optim_tuning.h"

int64_t stella_probe_random_rmw(float *buf, int64_t numel, const int32_t *idx, int64_t n, int32_t stride,
                                int32_t prefetch_distance) {
    if (!buf || (n > 0 && !idx) || stride < 1 || prefetch_distance < 0) return STELLA_E_ARG;
    for (int64_t j = 0; j < n; j++)
        if (idx[j] < 0 || (int64_t)idx[j] * stride >= numel) return STELLA_E_RANGE;
    const int64_t pd = prefetch_distance;
    for (int64_t j = 0; j < n; j++) {
        if (pd && j + pd < n) __builtin_prefetch(buf + (int64_t)idx[j + pd] * stride, 1, 3);
        float *p = buf + (int64_t)idx[j] * stride;
        *p = *p * 0.5f + 1.0f;
    }
    return n;
}

/* Layout probe for bench/layouts.py: the memory a server step touches per pushed
 * coordinate with the broadcast's residual R and model B beside the optimizer's record
 * (layout 0, today's: the AdamW records {p, m, v, step} at mem[0, 4 numel), R at
 * mem[4 numel, 5 numel), B at mem[5 numel, 6 numel)) or inside it (layout 1: one record
 * of 8 floats {p, m, v, step, R, B, -, -} a coordinate, 32 bytes). Phase 0, the apply: at
 * each idx[j] an AdamW-like update of the record from g[j], its change added to R. Phase
 * 1, the broadcast's selection: at each idx[j] R read and set to 0, B gains what was
 * read. Layout 2: the records alone, phase 0 without R (what the kernel's apply touches).
 * Every line an entry touches is prefetched pd entries ahead. */
int64_t stella_probe_layout(float *mem, int64_t numel, int32_t layout, int32_t phase, const int32_t *idx,
                            const float *g, int64_t n, int32_t prefetch_distance) {
    if (!mem || (n > 0 && (!idx || !g)) || numel < 0 || layout < 0 || layout > 2 || (phase != 0 && phase != 1) ||
        (layout == 2 && phase != 0) || prefetch_distance < 0)
        return STELLA_E_ARG;
    for (int64_t j = 0; j < n; j++)
        if (idx[j] < 0 || idx[j] >= numel) return STELLA_E_RANGE;
    const int64_t pd = prefetch_distance;
    const int64_t stride = layout == 1 ? 8 : 4;
    float *rec = mem, *R = layout == 1 ? mem + 4 : mem + 4 * numel, *B = layout == 1 ? mem + 5 : mem + 5 * numel;
    const int64_t rs = layout == 1 ? 8 : 1; /* R's and B's stride */
    for (int64_t j = 0; j < n; j++) {
        if (pd && j + pd < n) {
            const int64_t c = idx[j + pd];
            if (phase == 0) __builtin_prefetch(rec + c * stride, 1, 3);
            if (layout == 0) {
                __builtin_prefetch(R + c, 1, 3);
                if (phase == 1) __builtin_prefetch(B + c, 1, 3);
            } else if (phase == 1) {
                __builtin_prefetch(rec + c * stride, 1, 3);
            }
        }
        const int64_t c = idx[j];
        if (phase == 0) {
            float *p = rec + c * stride;
            const float gj = g[j];
            const float m = 0.9f * p[1] + 0.1f * gj, v = 0.999f * p[2] + 0.001f * gj * gj;
            const float d = -1e-3f * m / (__builtin_sqrtf(v) + 1e-8f);
            p[0] += d;
            p[1] = m;
            p[2] = v;
            p[3] += 1.0f;
            if (layout != 2) R[c * rs] += d;
        } else {
            const float x = R[c * rs];
            R[c * rs] = 0.0f;
            B[c * rs] += x;
        }
    }
    return n;
}
