/* flat.c compiled for x86-64-v3 (run-time dispatch: native/stella_isa.h). */
#define STELLA_ISA_SUFFIX _v3
#include "../stella_isa.h"
#if STELLA_ISA_DISPATCH
#pragma GCC target("arch=x86-64-v3")
#include "../flat.c"
#endif
