/* Shared prelude of every native/ source: fixed-width types, error codes, ABI. */
#ifndef STELLA_NATIVE_H
#define STELLA_NATIVE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Bumped whenever a signature or a struct in native/cdefs changes; the Python
 * wrappers assert it at import so a stale build fails loudly. */
#define STELLA_ABI_VERSION 1

/* Return codes shared by all kernels (0 = ok, negative = error). */
#define STELLA_OK 0
#define STELLA_E_RANGE (-1)     /* an index is >= the tensor's size */
#define STELLA_E_ORDER (-2)     /* indices not strictly increasing */
#define STELLA_E_NONFINITE (-3) /* a value is NaN or +-Inf */
#define STELLA_E_CORRUPT (-4)   /* coded bytes are malformed or truncated */
#define STELLA_E_ARG (-5)       /* bad argument (size, count, config) */
#define STELLA_E_NOMEM (-6)     /* allocation failed */

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

#endif
