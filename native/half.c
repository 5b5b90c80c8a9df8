/* Bulk f16 / bf16 <-> f32 conversion of wire values (cdefs/codec.h), with the one
 * converter of stella_half.h. Dispatched by ISA level (stella_isa.h): the x86-64-v3
 * copy converts f16 with F16C, 8 values an instruction, the v4 copy with AVX-512,
 * 16; the bf16 loops are plain C that the compiler vectorises to the level's width.
 * Every copy gives the same bits. */
#include "stella_native.h"
#include "stella_half.h"

#include "cdefs/codec.h"

void STELLA_ISA_FN(stella_f32_to_f16)(const float *in, int64_t n, uint16_t *out) { stella_f32_to_f16_n(in, n, out); }

void STELLA_ISA_FN(stella_f16_to_f32)(const uint16_t *in, int64_t n, float *out) { stella_f16_to_f32_n(in, n, out); }

void STELLA_ISA_FN(stella_f32_to_bf16)(const float *in, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = stella_float_to_bf16(in[i]);
}

void STELLA_ISA_FN(stella_bf16_to_f32)(const uint16_t *in, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = stella_bf16_to_float(in[i]);
}

#if STELLA_ISA_BASE
STELLA_ISA_VARIANTS(stella_f32_to_f16);
STELLA_ISA_VARIANTS(stella_f16_to_f32);
STELLA_ISA_VARIANTS(stella_f32_to_bf16);
STELLA_ISA_VARIANTS(stella_bf16_to_f32);

void stella_f32_to_f16(const float *in, int64_t n, uint16_t *out) { STELLA_ISA_PICK(stella_f32_to_f16)(in, n, out); }

void stella_f16_to_f32(const uint16_t *in, int64_t n, float *out) { STELLA_ISA_PICK(stella_f16_to_f32)(in, n, out); }

void stella_f32_to_bf16(const float *in, int64_t n, uint16_t *out) { STELLA_ISA_PICK(stella_f32_to_bf16)(in, n, out); }

void stella_bf16_to_f32(const uint16_t *in, int64_t n, float *out) { STELLA_ISA_PICK(stella_bf16_to_f32)(in, n, out); }
#endif
