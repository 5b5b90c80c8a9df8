/* Wire coding of sparse pushes: sorted unique int32 indices, float values
 * (f16, bf16 and the low-bit q4/q2 of pushes, whose format is above stella_q_size).
 *
 * Index codings (STELLA_IDX_* in cdefs/codec.h; docs/compression.md has the
 * byte-level format):
 *   0 raw32   count little-endian int32
 *   1 varint  LEB128 of the gaps g[i] = idx[i] - idx[i-1] - 1 (idx[-1] = -1)
 *   2 u16     per nonempty 65536-chunk: varint chunk gap, varint (n - 1),
 *             n little-endian u16 offsets
 *   3 rice    one byte b (0..31), then per gap: q = g >> b as q zero bits and a
 *             one bit, then the low b bits of g; bits fill bytes from the least
 *             significant bit; the last byte is zero-padded
 *   4 block16 the set is a union of whole aligned 16-element blocks (the last
 *             block of the tensor may be short): the block numbers idx / 16,
 *             coded exactly as rice over ceil(numel / 16) blocks
 * Every coding of an empty set is the empty byte string.
 *
 * Decoders never trust their input: every read is bounds-checked against the
 * buffer, every index checked < numel and strictly increasing (gap coding makes
 * that structural), the stream must end exactly at the buffer's end (padding
 * bits zero, encodings minimal), and anything else is STELLA_E_CORRUPT.
 */
#include <stdlib.h>
#include <string.h>

#include "stella_native.h"

#include "cdefs/codec.h"
#include "cdefs/compress.h"
#include "stella_half.h"

/* block16 is the wire form of the "block" method's selections. */
_Static_assert(STELLA_BLOCK == 16, "block16 codes 16-element blocks");

#define C_RAW32 STELLA_IDX_RAW32
#define C_VARINT STELLA_IDX_VARINT
#define C_U16 STELLA_IDX_U16CHUNK
#define C_RICE STELLA_IDX_RICE
#define C_BLOCK16 STELLA_IDX_BLOCK16

static inline int varint_len(uint32_t v) {
    return v < (1u << 7) ? 1 : v < (1u << 14) ? 2 : v < (1u << 21) ? 3 : v < (1u << 28) ? 4 : 5;
}

static inline uint8_t *put_varint(uint8_t *p, uint32_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

/* Reads one minimal LEB128 value < 2^31; returns bytes used or 0 if corrupt. */
static inline int get_varint(const uint8_t *p, const uint8_t *end, uint32_t *v) {
    uint32_t x = 0;
    for (int i = 0; i < 5; i++) {
        if (STELLA_UNLIKELY(p + i >= end)) return 0;
        uint32_t byte = p[i];
        if (i == 4 && byte > 0x07) return 0; /* >= 2^31 or a fifth continuation */
        x |= (byte & 0x7f) << (7 * i);
        if (!(byte & 0x80)) {
            if (i > 0 && byte == 0) return 0; /* not minimal */
            *v = x;
            return i + 1;
        }
    }
    return 0;
}

/* ---- Rice parameter -------------------------------------------------------- */

/* The b in 0..31 minimising C(b) = count * (1 + b) + S(b), S(b) = sum(g >> b), exactly
 * (the smallest such b). C is convex: C(b + 1) - C(b) = count - D(b) with D(b) =
 * S(b) - S(b + 1) = sum(ceil((g >> b) / 2)), and g >> b, hence D(b), falls as b
 * grows. So the answer is the smallest b with D(b) <= count (31 when there is none),
 * found by a walk from the b that a geometric distribution of the mean gap would
 * take: each step is one pass of shifts and adds over the gaps (vectorised), and
 * the walk takes one to three of them. */
static uint64_t rice_halves(const int32_t *idx, int64_t count, int b) {
    uint64_t d = ((uint64_t)((uint32_t)idx[0] >> b) + 1) >> 1; /* the first gap: idx[0] - (-1) - 1 */
    for (int64_t i = 1; i < count; i++) {
        const uint32_t g = (uint32_t)(idx[i] - idx[i - 1] - 1);
        d += ((g >> b) + 1) >> 1;
    }
    return d;
}

int32_t stella_rice_param(const int32_t *idx, int64_t count) {
    if (count <= 0) return 0;
    /* mean gap (idx[count-1] + 1 - count) / count; b ~ log2(mean ln 2) */
    const double mean = ((double)idx[count - 1] + 1.0 - (double)count) / (double)count;
    int b = 0;
    while (b < 31 && (double)(UINT64_C(1) << (b + 1)) <= mean * 0.6931471805599453) b++;
    if (rice_halves(idx, count, b) <= (uint64_t)count) { /* the answer is b or below */
        while (b > 0 && rice_halves(idx, count, b - 1) <= (uint64_t)count) b--;
    } else { /* above b */
        do b++;
        while (b < 31 && rice_halves(idx, count, b) > (uint64_t)count);
    }
    return b;
}

/* ---- bounds ---------------------------------------------------------------- */

int64_t stella_idx_bound(int64_t count, int64_t numel, int32_t coding) {
    if (count < 0 || numel < 0 || numel > STELLA_MAX_CODED_NUMEL || count > numel) return STELLA_E_ARG;
    if (count == 0) return 0;
    switch (coding) {
    case C_RAW32: return 4 * count;
    case C_VARINT: return 5 * count;
    case C_U16: {
        int64_t chunks = (numel + 65535) >> 16;
        int64_t nz = chunks < count ? chunks : count;
        return 2 * count + 10 * nz;
    }
    case C_RICE: return 1 + 4 * count + 8; /* b = 31 costs 32 bits a gap; the best costs no more */
    case C_BLOCK16: return 1 + 4 * ((count + 15) / 16) + 8;
    default: return STELLA_E_ARG;
    }
}

/* ---- encoders -------------------------------------------------------------- */

/* LSB-first bit writer: whole 32-bit words go out as soon as they are complete, so
 * fewer than 32 bits are pending between calls. */
typedef struct {
    uint8_t *p, *end;
    uint64_t acc;
    int nacc;
} bitw;

/* Append the n low bits of v (n <= 32, v < 2^n); STELLA_E_ARG when the output is full. */
static inline int bitw_put(bitw *w, uint64_t v, int n) {
    w->acc |= v << w->nacc; /* nacc < 32, n <= 32: fits in 64 bits */
    w->nacc += n;
    if (w->nacc >= 32) {
        if (STELLA_UNLIKELY(w->end - w->p < 4)) return STELLA_E_ARG;
        stella_store32le(w->p, (uint32_t)w->acc);
        w->p += 4;
        w->acc >>= 32;
        w->nacc -= 32;
    }
    return STELLA_OK;
}

static int64_t enc_rice(const int32_t *idx, int64_t count, uint8_t *out, int64_t cap) {
    int b = stella_rice_param(idx, count);
    bitw w = {out + 1, out + cap, 0, 0};
    out[0] = (uint8_t)b;
    int64_t prev = -1;
    const uint32_t mask = (1u << b) - 1u; /* b <= 31 */
    for (int64_t i = 0; i < count; i++) {
        uint32_t g = (uint32_t)((int64_t)idx[i] - prev - 1);
        prev = idx[i];
        uint32_t q = g >> b;
        if (STELLA_LIKELY(q + 1 + (uint32_t)b <= 32)) { /* the whole code in one put (the common case) */
            if (bitw_put(&w, ((uint64_t)1 << q) | ((uint64_t)(g & mask) << (q + 1)), (int)q + 1 + b))
                return STELLA_E_ARG;
            continue;
        }
        for (; q >= 32; q -= 32) /* a long run of zero bits */
            if (bitw_put(&w, 0, 32)) return STELLA_E_ARG;
        if (bitw_put(&w, (uint64_t)1 << q, (int)q + 1)) return STELLA_E_ARG; /* q zeros then a one */
        if (bitw_put(&w, g & mask, b)) return STELLA_E_ARG;
    }
    while (w.nacc > 0) {
        if (STELLA_UNLIKELY(w.p >= w.end)) return STELLA_E_ARG;
        *w.p++ = (uint8_t)w.acc;
        w.acc >>= 8;
        w.nacc -= 8;
    }
    return w.p - out;
}

int64_t stella_idx_encode(const int32_t *idx, int64_t count, int64_t numel, int32_t coding,
                          uint8_t *out, int64_t cap) {
    int64_t bound = stella_idx_bound(count, numel, coding);
    if (bound < 0) return bound;
    if (cap < bound || (count > 0 && (!idx || !out))) return STELLA_E_ARG;
    int rc = stella_check_sorted(idx, count, numel, NULL);
    if (rc) return rc;
    if (count == 0) return 0;
    switch (coding) {
    case C_RAW32:
        for (int64_t i = 0; i < count; i++) {
            uint32_t v = (uint32_t)idx[i];
            out[4 * i] = (uint8_t)v;
            out[4 * i + 1] = (uint8_t)(v >> 8);
            out[4 * i + 2] = (uint8_t)(v >> 16);
            out[4 * i + 3] = (uint8_t)(v >> 24);
        }
        return 4 * count;
    case C_VARINT: {
        uint8_t *p = out;
        int64_t prev = -1;
        for (int64_t i = 0; i < count; i++) {
            p = put_varint(p, (uint32_t)((int64_t)idx[i] - prev - 1));
            prev = idx[i];
        }
        return p - out;
    }
    case C_U16: {
        uint8_t *p = out;
        int64_t prev_chunk = -1;
        int64_t i = 0;
        while (i < count) {
            int64_t c = (int64_t)idx[i] >> 16;
            int64_t j = i;
            while (j < count && ((int64_t)idx[j] >> 16) == c) j++;
            p = put_varint(p, (uint32_t)(c - prev_chunk - 1));
            p = put_varint(p, (uint32_t)(j - i - 1));
            for (; i < j; i++) {
                uint32_t o = (uint32_t)idx[i] & 0xffffu;
                *p++ = (uint8_t)o;
                *p++ = (uint8_t)(o >> 8);
            }
            prev_chunk = c;
        }
        return p - out;
    }
    case C_RICE: return enc_rice(idx, count, out, cap);
    case C_BLOCK16: {
        int64_t nb = (count + 15) / 16, j = 0, i = 0;
        int32_t *blk = malloc((size_t)nb * sizeof(int32_t));
        if (!blk) return STELLA_E_NOMEM;
        while (i < count) {
            int64_t s0 = idx[i];
            int64_t len = numel - s0 < 16 ? numel - s0 : 16;
            if ((s0 & 15) || i + len > count || j >= nb || idx[i + len - 1] != s0 + len - 1) {
                free(blk);
                return STELLA_E_ARG; /* not whole blocks (sorted + unique: the last one decides) */
            }
            blk[j++] = (int32_t)(s0 >> 4);
            i += len;
        }
        int64_t r = enc_rice(blk, j, out, cap);
        free(blk);
        return r;
    }
    default: return STELLA_E_ARG;
    }
}

/* ---- decoders -------------------------------------------------------------- */

/* Up to 57 bits at bit position pos (LSB first), zeros past the end. */
static inline uint64_t peek_bits(const uint8_t *s, int64_t nbytes, int64_t pos) {
    int64_t byte = pos >> 3;
    uint64_t w = 0;
    if (STELLA_LIKELY(byte + 8 <= nbytes)) {
        memcpy(&w, s + byte, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
    } else {
        for (int64_t k = 0; byte + k < nbytes && k < 8; k++) w |= (uint64_t)s[byte + k] << (8 * k);
    }
    return w >> (pos & 7);
}

static int64_t dec_rice(const uint8_t *buf, int64_t len, int64_t count, int64_t numel,
                        int32_t *out) {
    if (len < 2) return STELLA_E_CORRUPT;
    int b = buf[0];
    if (b > 31) return STELLA_E_CORRUPT;
    const uint8_t *s = buf + 1;
    int64_t nbytes = len - 1, nbits = nbytes * 8, pos = 0;
    /* every gap takes at least b + 1 bits */
    if ((uint64_t)count * (uint64_t)(b + 1) > (uint64_t)nbits) return STELLA_E_CORRUPT;
    const uint64_t qmax = (uint64_t)numel >> b; /* q > qmax means an index >= numel */
    const uint64_t mask = (UINT64_C(1) << b) - 1;
    int64_t prev = -1;
    for (int64_t i = 0; i < count; i++) {
        /* Fast path: one 8-byte load holds at least 57 bits from pos, and every code
         * that lies whole in them (q + 1 + b bits; nearly all codes, several a load) is
         * read from the register: the chain from one code to the next is a count of
         * trailing zeros and a shift, no load. The index check also catches q > qmax.
         * The general loop below handles the rest and the last bytes. */
        if (STELLA_LIKELY((pos >> 3) + 8 <= nbytes)) {
            uint64_t w;
            memcpy(&w, s + (pos >> 3), 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            w = __builtin_bswap64(w);
#endif
            w >>= pos & 7;
            int avail = 57;
            const int64_t i0 = i;
            while (i < count && w != 0) {
                const int z = __builtin_ctzll(w);
                const int n = z + 1 + b;
                if (n > avail) break;
                const int64_t x = prev + 1 + (int64_t)(((uint64_t)z << b) | ((w >> (z + 1)) & mask));
                if (STELLA_UNLIKELY(x >= numel)) return STELLA_E_CORRUPT;
                out[i++] = (int32_t)x;
                prev = x;
                pos += n;
                avail -= n;
                w >>= n; /* n <= avail <= 57 */
            }
            if (STELLA_LIKELY(i > i0)) {
                i--; /* the loop's i++ */
                continue;
            }
        }
        uint64_t q = 0;
        for (;;) {
            uint64_t w = peek_bits(s, nbytes, pos);
            uint64_t avail = 57;
            w &= (UINT64_C(1) << avail) - 1;
            if (w) {
                int z = __builtin_ctzll(w);
                q += (uint64_t)z;
                pos += z + 1;
                break;
            }
            q += avail;
            pos += (int64_t)avail;
            if (STELLA_UNLIKELY(pos >= nbits || q > qmax)) return STELLA_E_CORRUPT;
        }
        if (STELLA_UNLIKELY(q > qmax || pos + b > nbits)) return STELLA_E_CORRUPT;
        uint64_t r = b ? (peek_bits(s, nbytes, pos) & mask) : 0;
        pos += b;
        int64_t x = prev + 1 + (int64_t)((q << b) | r);
        if (STELLA_UNLIKELY(x >= numel)) return STELLA_E_CORRUPT;
        out[i] = (int32_t)x;
        prev = x;
    }
    /* the stream ends in the last byte, whose remaining bits are zero */
    if ((pos + 7) >> 3 != nbytes) return STELLA_E_CORRUPT;
    if (pos & 7) {
        uint8_t last = s[nbytes - 1];
        if (last >> (pos & 7)) return STELLA_E_CORRUPT;
    }
    return count;
}

int64_t stella_idx_decode(const uint8_t *buf, int64_t len, int64_t count, int64_t numel,
                          int32_t coding, int32_t *out) {
    if (len < 0 || count < 0 || numel < 0 || numel > STELLA_MAX_CODED_NUMEL) return STELLA_E_ARG;
    if (coding < C_RAW32 || coding > C_BLOCK16) return STELLA_E_ARG;
    if (count > numel) return STELLA_E_CORRUPT;
    if (count == 0) return len == 0 ? 0 : STELLA_E_CORRUPT;
    if (!buf || !out) return STELLA_E_ARG;
    switch (coding) {
    case C_RAW32: {
        if (len != 4 * count) return STELLA_E_CORRUPT;
        int64_t prev = -1;
        for (int64_t i = 0; i < count; i++) {
            const uint8_t *p = buf + 4 * i;
            int64_t x = (int32_t)stella_load32le(p);
            /* distinct codes so the sender learns which rule it broke */
            if (STELLA_UNLIKELY(x < 0 || x >= numel)) return STELLA_E_RANGE;
            if (STELLA_UNLIKELY(x <= prev)) return STELLA_E_ORDER;
            out[i] = (int32_t)x;
            prev = x;
        }
        return count;
    }
    case C_VARINT: {
        if (count > len) return STELLA_E_CORRUPT;
        const uint8_t *p = buf, *end = buf + len;
        int64_t prev = -1;
        for (int64_t i = 0; i < count; i++) {
            uint32_t g;
            if (STELLA_LIKELY(p < end && *p < 0x80)) { /* one-byte gap: the common case */
                g = *p++;
            } else {
                int used = get_varint(p, end, &g);
                if (STELLA_UNLIKELY(!used)) return STELLA_E_CORRUPT;
                p += used;
            }
            int64_t x = prev + 1 + (int64_t)g;
            if (STELLA_UNLIKELY(x >= numel)) return STELLA_E_RANGE;
            out[i] = (int32_t)x;
            prev = x;
        }
        return p == end ? count : STELLA_E_CORRUPT;
    }
    case C_U16: {
        if (2 * count > len) return STELLA_E_CORRUPT;
        const uint8_t *p = buf, *end = buf + len;
        int64_t chunk = -1, i = 0;
        while (i < count) {
            uint32_t cg, cm1;
            int u = get_varint(p, end, &cg);
            if (!u) return STELLA_E_CORRUPT;
            p += u;
            u = get_varint(p, end, &cm1);
            if (!u) return STELLA_E_CORRUPT;
            p += u;
            chunk += 1 + (int64_t)cg;
            if (chunk > (STELLA_MAX_CODED_NUMEL >> 16)) return STELLA_E_CORRUPT;
            int64_t m = (int64_t)cm1 + 1;
            int64_t base = chunk << 16;
            if (m > 65536 || m > count - i || base >= numel || 2 * m > end - p)
                return STELLA_E_CORRUPT;
            int64_t prev = -1;
            for (int64_t j = 0; j < m; j++) {
                int64_t o = (int64_t)p[2 * j] | (int64_t)p[2 * j + 1] << 8;
                if (STELLA_UNLIKELY(o <= prev)) return STELLA_E_CORRUPT;
                prev = o;
                out[i + j] = (int32_t)(base + o);
            }
            if (base + prev >= numel) return STELLA_E_CORRUPT; /* the last is the largest */
            p += 2 * m;
            i += m;
        }
        return p == end ? count : STELLA_E_CORRUPT;
    }
    case C_RICE: return dec_rice(buf, len, count, numel, out);
    case C_BLOCK16: {
        int64_t nblocks = (numel + 15) / 16, tail = numel & 15;
        int64_t rem = count & 15;
        if (rem != 0 && rem != tail) return STELLA_E_CORRUPT;
        int64_t nb = (count + 15) / 16;
        int64_t r = dec_rice(buf, len, nb, nblocks, out); /* block numbers in out[0..nb) */
        if (r < 0) return r;
        int has_tail = tail != 0 && out[nb - 1] == nblocks - 1;
        if (has_tail != (rem != 0)) return STELLA_E_CORRUPT; /* count must match the blocks */
        for (int64_t j = nb - 1; j >= 0; j--) { /* expand in place, last block first */
            int64_t s0 = (int64_t)out[j] << 4;
            int64_t l = numel - s0 < 16 ? numel - s0 : 16;
            for (int64_t t = l - 1; t >= 0; t--) out[16 * j + t] = (int32_t)(s0 + t);
        }
        return count;
    }
    }
    return STELLA_E_ARG;
}

/* ---- values ---------------------------------------------------------------- */

/* The bulk f16/bf16 converters are in half.c (dispatched by ISA level, stella_isa.h). */

/* A value is NaN or Inf exactly when its exponent bits are all ones. No branch per
 * value (the loops vectorise); each block of 4096 can end the scan. */
#define SCAN_BLOCK 4096

static int all_finite32(const uint32_t *v, int64_t n, uint32_t exp_mask) {
    for (int64_t i0 = 0; i0 < n; i0 += SCAN_BLOCK) {
        const int64_t i1 = n - i0 < SCAN_BLOCK ? n : i0 + SCAN_BLOCK;
        uint32_t bad = 0;
        for (int64_t i = i0; i < i1; i++) bad |= (v[i] & exp_mask) == exp_mask;
        if (bad) return 0;
    }
    return 1;
}

static int all_finite16(const uint16_t *v, int64_t n, uint16_t exp_mask) {
    for (int64_t i0 = 0; i0 < n; i0 += SCAN_BLOCK) {
        const int64_t i1 = n - i0 < SCAN_BLOCK ? n : i0 + SCAN_BLOCK;
        uint16_t bad = 0;
        for (int64_t i = i0; i < i1; i++) bad |= (uint16_t)(v[i] & exp_mask) == exp_mask;
        if (bad) return 0;
    }
    return 1;
}

int stella_values_check(const void *val, int64_t n, int32_t dtype) {
    if (n < 0 || (n > 0 && !val)) return STELLA_E_ARG;
    int ok;
    switch (dtype) {
    case STELLA_VAL_F32: ok = all_finite32(val, n, 0x7f800000u); break;
    case STELLA_VAL_F16: ok = all_finite16(val, n, 0x7c00u); break;
    case STELLA_VAL_BF16: ok = all_finite16(val, n, 0x7f80u); break;
    default: return STELLA_E_ARG;
    }
    return ok ? STELLA_OK : STELLA_E_NONFINITE;
}
