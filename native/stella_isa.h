/* Run-time choice of the x86-64 level the hot kernels run at.
 *
 * The SIMD paths of the kernels are chosen by the preprocessor (__AVX512F__,
 * __AVX512BW__, __F16C__ in compress.c, merge.c and stella_half.h). To use them from
 * one portable build, each dispatched source is compiled three times into the same
 * module: as itself, at the build's -march ("portable"), and through the wrappers
 * native/isa/<source>_v3.c and _v4.c, which put `#pragma GCC target("arch=x86-64-v3")`
 * (resp. v4) before including it. GCC then defines the ISA macros of that level, so
 * the one implementation compiles with its SIMD branches. Each copy names its entry
 * points with STELLA_ISA_FN (name_portable, name_v3, name_v4), and the base copy
 * defines the public name as a dispatcher (STELLA_ISA_PICK) to the level chosen once
 * by core.c: the best one this CPU runs, or the one asked for in the environment
 * variable STELLA_NATIVE_ISA (auto | portable | x86-64-v3 | x86-64-v4; a level the CPU
 * lacks falls back to the best it has). stella_native_isa() names the choice.
 *
 * Only GCC 11+ on x86-64 builds the variants (the pragma defines the macros there; the
 * level names are GCC 11's). Elsewhere (aarch64, clang, other compilers) every
 * STELLA_ISA_FN(name) is plain `name`, no wrapper compiles anything, and the one
 * level is "portable". -DSTELLA_NO_DISPATCH forces that on x86-64 as well.
 */
#ifndef STELLA_ISA_H
#define STELLA_ISA_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && \
    !defined(STELLA_NO_DISPATCH)
#define STELLA_ISA_DISPATCH 1
#else
#define STELLA_ISA_DISPATCH 0
#endif

/* Levels, in order; STELLA_ISA_NAMES has their names. */
#define STELLA_ISA_PORTABLE 0
#define STELLA_ISA_V3 1
#define STELLA_ISA_V4 2
#define STELLA_ISA_LEVELS 3
#define STELLA_ISA_NAMES {"portable", "x86-64-v3", "x86-64-v4"}

#define STELLA_ISA_CAT_(a, b) a##b
#define STELLA_ISA_CAT(a, b) STELLA_ISA_CAT_(a, b)

/* STELLA_ISA_SUFFIX (_v3, _v4) is defined by the wrappers in native/isa/ only.
 * STELLA_ISA_VARIANT: this translation unit is a v3/v4 copy (it leaves out what is
 * not dispatched). STELLA_ISA_BASE: this is the base copy of a dispatched source
 * (it defines the dispatchers). */
#if !STELLA_ISA_DISPATCH
#define STELLA_ISA_FN(name) name
#define STELLA_ISA_VARIANT 0
#define STELLA_ISA_BASE 0
#elif defined(STELLA_ISA_SUFFIX)
#define STELLA_ISA_FN(name) STELLA_ISA_CAT(name, STELLA_ISA_SUFFIX)
#define STELLA_ISA_VARIANT 1
#define STELLA_ISA_BASE 0
#else
#define STELLA_ISA_FN(name) STELLA_ISA_CAT(name, _portable)
#define STELLA_ISA_VARIANT 0
#define STELLA_ISA_BASE 1
#endif

/* core.c: the chosen level (STELLA_ISA_*), resolved on the first call. */
int stella_isa_level(void);

#if STELLA_ISA_BASE
/* Declares the v3 and v4 copies of an entry point like its portable one. */
#define STELLA_ISA_VARIANTS(name) __typeof__(name##_portable) name##_v3, name##_v4
/* The copy of an entry point at the chosen level. */
#define STELLA_ISA_PICK(name)                                                                   \
    (stella_isa_level() == STELLA_ISA_V4   ? name##_v4                                         \
     : stella_isa_level() == STELLA_ISA_V3 ? name##_v3                                         \
                                           : name##_portable)
#endif

#endif
