/* The SIMD kernels a compiled matvec can run, chosen at run time (shared by _mxfp4_matvec.c and
   _bf16_matvec.c): 0 portable C, 1 AVX2+FMA, 2 AVX-512F. The best one this CPU has is used unless
   one is asked for by name (tests run every one). */

#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KX_X86 1
#include <immintrin.h>
#endif

/* The row kernel for isa index `isa`: each including file defines row_portable, and on x86
   row_avx2 and row_avx512, all of its own row_fn type. */
#ifdef KX_X86
#define KX_ROW_KERNEL(isa) ((isa) == 2 ? row_avx512 : (isa) == 1 ? row_avx2 : row_portable)
#else
#define KX_ROW_KERNEL(isa) row_portable
#endif

static const char *const ISA_NAMES[] = {"portable", "avx2", "avx512f"};

static int best_isa(void) {
#ifdef KX_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

/* The index of kernel `name` ('' = the best), or -1 when this CPU cannot run it. */
static int isa_index(const char *name) {
    if (!*name) return best_isa();
    for (int i = 0; i <= best_isa(); i++)
        if (strcmp(name, ISA_NAMES[i]) == 0) return i;
    return -1;
}

static PyObject *isas(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    int best = best_isa();
    PyObject *names = PyTuple_New(best + 1);
    if (names == NULL) return NULL;
    for (int i = 0; i <= best; i++) PyTuple_SET_ITEM(names, i, PyUnicode_FromString(ISA_NAMES[i]));
    return names;
}
