/* Native products with a weight in its stored dtype: y[m, out] = x[m, in] @ W.T, x and y float32.
 *
 * The weight is never expanded whole: one-row products (decode) stream each weight row once and multiply in
 * registers; several rows of x (prefill) decode one weight row at a time into a per-thread float32 row and take
 * every x row's product with it, so each weight row is read once per call. Kinds and layouts are those of
 * runtime/model/_packed.py (`Packed`), which is the only caller and keeps the numpy reference each kind must
 * agree with.
 *
 * x86-64: AVX2+FMA+F16C kernels compiled with a per-function target attribute and chosen at run time
 * (__builtin_cpu_supports), so the module builds and runs on any x86-64 or aarch64 with the plain C fallback. Where
 * the CPU also has AVX-512 (F and BW), one-row products take 512-bit kernels for the block kinds (q8, q4, mxfp4:
 * integer arithmetic, bound by instruction count rather than memory) and for float32 and float16 weights' rows in
 * fours; every other product stays on AVX2.
 * Threads: output rows are split across a small pool of pthreads (re-created after fork); the GIL is released
 * while they compute. Every buffer is checked (C-contiguous, format, itemsize, exact byte length) before any
 * read: a mismatch is a ValueError, never an out-of-bounds read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86_KERNELS 1
#include <immintrin.h>
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
/* a superset of TARGET_AVX2, so its functions inline the AVX2 helpers */
#define TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw")))
#else
#define HAVE_X86_KERNELS 0
#endif

#define QBLOCK 32
enum simd { SIMD_PLAIN, SIMD_AVX2, SIMD_AVX512 };
static const char *const SIMD_NAMES[] = {"plain", "avx2", "avx512"};
#define MAX_THREADS 64
#define MIN_CHUNK_ROWS 16 /* rows of one thread's piece of a product, at least */
#define X_TILE_BYTES 24576 /* x rows of a several-row float32 product taken together: half a 48 KiB L1 data cache */
#define MAX_TOP_K 1024 /* the most experts a row routes to that route_softmax and moe_row take (module MAX_TOP_K) */
#define GIL_WORK 16384 /* weights + inputs below which a product runs on one thread, keeping the GIL */

enum kind { K_F32, K_F16, K_BF16, K_FP8, K_Q8, K_Q4, K_MXFP4, K_COUNT };
static const char *const KIND_NAMES[K_COUNT] = {"f32", "f16", "bf16", "fp8", "q8", "q4", "mxfp4"};

typedef struct job_s {
    int kind;
    Py_ssize_t m, out, in, b0, b1;
    const float *x;
    const void *w;
    const void *scale;
    float *y;
    int simd; /* its kernels: SIMD_PLAIN, SIMD_AVX2 or SIMD_AVX512 (AVX2 but in dot_quant_x16, dot4_f32/f16) */
    /* one-row products with the integer kinds (q8, q4, mxfp4) on AVX2 or AVX-512: x as int16 with a power-of-two
     * scale per block of 32 (exact integer products; |x - xq * xs| <= 2^-15 * the block's largest |x|), else NULL */
    const int16_t *xq;
    const float *xs;
    /* q4 with xq on AVX2: xc[4 * b] = 8 * the sum of xq's block b, xc[4 * b + 1..3] = 0 (see block_q4_x16), else NULL
     * (the AVX-512 kernel subtracts 8 from each code instead) */
    const int32_t *xc;
    /* SwiGLU's gate job: `up`, the up product over the same rows and x (its y the [m, out] u); each chunk of rows
     * computes both products, then y = silu(y) * u on those rows. NULL for a plain product. */
    struct job_s *up;
} job_t;

/* ---------------------------------------------------------------- scalar conversions (the fallback's, and tails) */

static float fp8_table[256]; /* float8_e4m3fn -> float32, NaN for 0x7F/0xFF */
static float fp4_table[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0x1F)
        return bits_to_float(sign | 0x7F800000u | (mant << 13));
    if (exp == 0) {
        float v = ldexpf((float)mant, -24);
        return sign ? -v : v;
    }
    return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

static inline float bf16_to_float(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

/* E8M0 (MXFP4's scale byte): 2^(s - 127); s == 0 is 2^-127, a float32 subnormal; 0xFF (NaN) gives inf, and
 * is refused before a weight is ever packed. */
static inline float e8m0_to_float(uint8_t s) { return s ? bits_to_float((uint32_t)s << 23) : bits_to_float(0x00400000u); }

static void init_tables(void) {
    for (int b = 0; b < 256; b++) {
        int exp = (b >> 3) & 0xF, mant = b & 7;
        float v;
        if ((b & 0x7F) == 0x7F)
            v = NAN;
        else if (exp == 0)
            v = ldexpf((float)mant, -9);
        else
            v = ldexpf(1.0f + mant / 8.0f, exp - 7);
        fp8_table[b] = (b & 0x80) ? -v : v;
    }
}

/* ---------------------------------------------------------------- plain C: decode one weight row, dot products */

static void decode_row(const job_t *j, Py_ssize_t r, float *dst) {
    const Py_ssize_t n = j->in;
    switch (j->kind) {
    case K_F32:
        memcpy(dst, (const float *)j->w + r * n, (size_t)n * 4);
        break;
    case K_F16: {
        const uint16_t *w = (const uint16_t *)j->w + r * n;
        for (Py_ssize_t i = 0; i < n; i++) dst[i] = half_to_float(w[i]);
        break;
    }
    case K_BF16: {
        const uint16_t *w = (const uint16_t *)j->w + r * n;
        for (Py_ssize_t i = 0; i < n; i++) dst[i] = bf16_to_float(w[i]);
        break;
    }
    case K_FP8: {
        const uint8_t *w = (const uint8_t *)j->w + r * n;
        const Py_ssize_t sc = (n + j->b1 - 1) / j->b1;
        const float *s = (const float *)j->scale + (r / j->b0) * sc;
        for (Py_ssize_t c0 = 0, cb = 0; c0 < n; c0 += j->b1, cb++) {
            const Py_ssize_t c1 = c0 + j->b1 < n ? c0 + j->b1 : n;
            for (Py_ssize_t i = c0; i < c1; i++) dst[i] = fp8_table[w[i]] * s[cb];
        }
        break;
    }
    case K_Q8: {
        const int8_t *w = (const int8_t *)j->w + r * n;
        const uint16_t *d = (const uint16_t *)j->scale + r * (n / QBLOCK);
        for (Py_ssize_t b = 0; b < n / QBLOCK; b++) {
            const float scale = half_to_float(d[b]);
            for (int k = 0; k < QBLOCK; k++) dst[b * QBLOCK + k] = (float)w[b * QBLOCK + k] * scale;
        }
        break;
    }
    case K_Q4: {
        const uint8_t *w = (const uint8_t *)j->w + r * (n / 2);
        const uint16_t *d = (const uint16_t *)j->scale + r * (n / QBLOCK);
        for (Py_ssize_t b = 0; b < n / QBLOCK; b++) {
            float s = half_to_float(d[b]);
            for (int k = 0; k < QBLOCK / 2; k++) {
                uint8_t v = w[b * (QBLOCK / 2) + k];
                dst[b * QBLOCK + k] = (float)((int)(v & 0x0F) - 8) * s;
                dst[b * QBLOCK + k + QBLOCK / 2] = (float)((int)(v >> 4) - 8) * s;
            }
        }
        break;
    }
    case K_MXFP4: {
        const uint8_t *w = (const uint8_t *)j->w + r * (n / 2);
        const uint8_t *e = (const uint8_t *)j->scale + r * (n / QBLOCK);
        for (Py_ssize_t b = 0; b < n / QBLOCK; b++) {
            float s = e8m0_to_float(e[b]);
            for (int k = 0; k < QBLOCK / 2; k++) {
                uint8_t v = w[b * (QBLOCK / 2) + k];
                dst[b * QBLOCK + 2 * k] = fp4_table[v & 0x0F] * s;
                dst[b * QBLOCK + 2 * k + 1] = fp4_table[v >> 4] * s;
            }
        }
        break;
    }
    }
}

static float dot_plain(const float *x, const float *w, Py_ssize_t n) {
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        a0 += x[i] * w[i];
        a1 += x[i + 1] * w[i + 1];
        a2 += x[i + 2] * w[i + 2];
        a3 += x[i + 3] * w[i + 3];
    }
    for (; i < n; i++) a0 += x[i] * w[i];
    return (a0 + a1) + (a2 + a3);
}

/* ---------------------------------------------------------------- AVX2 + FMA + F16C */
#if HAVE_X86_KERNELS

TARGET_AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX2 static float dot_f32_avx2(const float *x, const float *w, Py_ssize_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s += x[i] * w[i];
    return s;
}

TARGET_AVX2 static inline __m256 load_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

TARGET_AVX2 static inline __m256 load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

#define DOT16_BODY(LOAD)                                                                                           \
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps(); \
    Py_ssize_t i = 0;                                                                                              \
    for (; i + 32 <= n; i += 32) {                                                                                 \
        a0 = _mm256_fmadd_ps(LOAD(w + i), _mm256_loadu_ps(x + i), a0);                                             \
        a1 = _mm256_fmadd_ps(LOAD(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);                                     \
        a2 = _mm256_fmadd_ps(LOAD(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);                                   \
        a3 = _mm256_fmadd_ps(LOAD(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);                                   \
    }                                                                                                              \
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(LOAD(w + i), _mm256_loadu_ps(x + i), a0);                     \
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));

TARGET_AVX2 static float dot_bf16_avx2(const float *x, const uint16_t *w, Py_ssize_t n) {
    DOT16_BODY(load_bf16)
    for (; i < n; i++) s += x[i] * bf16_to_float(w[i]);
    return s;
}

TARGET_AVX2 static float dot_f16_avx2(const float *x, const uint16_t *w, Py_ssize_t n) {
    DOT16_BODY(load_f16)
    for (; i < n; i++) s += x[i] * _cvtsh_ss(w[i]);
    return s;
}

/* Four weight rows `step` rows apart (row length n) against one x: x is loaded once for four rows, four streams run;
 * y[0], y[step], y[2 step], y[3 step] are theirs. Each row's sum is the same operations in the same order whatever
 * `step`: run_rows picks it so that the four streams are long (see there). */
#define DOT4_BODY(T, LOAD, SCALAR)                                                                                \
    const T *w0 = w, *w1 = w + step * n, *w2 = w + 2 * step * n, *w3 = w + 3 * step * n;                           \
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps(); \
    Py_ssize_t i = 0;                                                                                              \
    for (; i + 8 <= n; i += 8) {                                                                                   \
        const __m256 xv = _mm256_loadu_ps(x + i);                                                                  \
        a0 = _mm256_fmadd_ps(LOAD(w0 + i), xv, a0);                                                                \
        a1 = _mm256_fmadd_ps(LOAD(w1 + i), xv, a1);                                                                \
        a2 = _mm256_fmadd_ps(LOAD(w2 + i), xv, a2);                                                                \
        a3 = _mm256_fmadd_ps(LOAD(w3 + i), xv, a3);                                                                \
    }                                                                                                              \
    float s0 = hsum8(a0), s1 = hsum8(a1), s2 = hsum8(a2), s3 = hsum8(a3);                                          \
    for (; i < n; i++) {                                                                                           \
        s0 += x[i] * SCALAR(w0[i]);                                                                                \
        s1 += x[i] * SCALAR(w1[i]);                                                                                \
        s2 += x[i] * SCALAR(w2[i]);                                                                                \
        s3 += x[i] * SCALAR(w3[i]);                                                                                \
    }                                                                                                              \
    y[0] = s0;                                                                                                     \
    y[step] = s1;                                                                                                  \
    y[2 * step] = s2;                                                                                              \
    y[3 * step] = s3;

#define F32_SCALAR(v) (v)
TARGET_AVX2 static void dot4_f32_avx2(const float *x, const float *w, Py_ssize_t n, Py_ssize_t step, float *y) {
    DOT4_BODY(float, _mm256_loadu_ps, F32_SCALAR)
}

/* The same with AVX-512, float32 and float16 rows alike (so a float16 weight gives the bits of float32 weights of the
 * same values, as on AVX2): 16 weights a step; the last partial step takes x through a masked load (which never reads
 * the masked-out floats) and the weights through LOAD_TAIL, zero beyond n. The sums are grouped differently from
 * DOT4_BODY's, so AVX-512 and AVX2 agree within float32 rounding, not bit for bit. */
#define DOT4_Z_BODY(T, LOAD, LOAD_TAIL)                                                                             \
    const T *w0 = w, *w1 = w + step * n, *w2 = w + 2 * step * n, *w3 = w + 3 * step * n;                            \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                                     \
    Py_ssize_t i = 0;                                                                                               \
    for (; i + 16 <= n; i += 16) {                                                                                  \
        const __m512 xv = _mm512_loadu_ps(x + i);                                                                   \
        a0 = _mm512_fmadd_ps(LOAD(w0 + i), xv, a0);                                                                 \
        a1 = _mm512_fmadd_ps(LOAD(w1 + i), xv, a1);                                                                 \
        a2 = _mm512_fmadd_ps(LOAD(w2 + i), xv, a2);                                                                 \
        a3 = _mm512_fmadd_ps(LOAD(w3 + i), xv, a3);                                                                 \
    }                                                                                                               \
    if (i < n) {                                                                                                    \
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);                                                      \
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);                                                          \
        a0 = _mm512_fmadd_ps(LOAD_TAIL(m, w0 + i, n - i), xv, a0);                                                  \
        a1 = _mm512_fmadd_ps(LOAD_TAIL(m, w1 + i, n - i), xv, a1);                                                  \
        a2 = _mm512_fmadd_ps(LOAD_TAIL(m, w2 + i, n - i), xv, a2);                                                  \
        a3 = _mm512_fmadd_ps(LOAD_TAIL(m, w3 + i, n - i), xv, a3);                                                  \
    }                                                                                                               \
    y[0] = _mm512_reduce_add_ps(a0);                                                                                \
    y[step] = _mm512_reduce_add_ps(a1);                                                                             \
    y[2 * step] = _mm512_reduce_add_ps(a2);                                                                         \
    y[3 * step] = _mm512_reduce_add_ps(a3);

#define F32_TAIL(m, p, count) _mm512_maskz_loadu_ps(m, p)
TARGET_AVX512 static void dot4_f32_avx512(const float *x, const float *w, Py_ssize_t n, Py_ssize_t step, float *y) {
    DOT4_Z_BODY(float, _mm512_loadu_ps, F32_TAIL)
}

TARGET_AVX512 static inline __m512 load16_bf16(const uint16_t *p) { /* load_bf16's widening, 16 at a time */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

TARGET_AVX512 static inline __m512 load16_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* The last count < 16 float16 weights, zero beyond (copied: a masked 16-bit load would need AVX-512 VL). */
TARGET_AVX512 static inline __m512 tail16_f16(__mmask16 m, const uint16_t *p, Py_ssize_t count) {
    uint16_t part[16] = {0};
    (void)m;
    memcpy(part, p, (size_t)count * sizeof(uint16_t));
    return load16_f16(part);
}

TARGET_AVX512 static void dot4_f16_avx512(const float *x, const uint16_t *w, Py_ssize_t n, Py_ssize_t step, float *y) {
    DOT4_Z_BODY(uint16_t, load16_f16, tail16_f16)
}

/* The bf16 four-row kernels' end: elements [i, n) of rows w + k step n (k < 4) one by one into their sums s (each in
 * element order), then y[k step] = s[k]. */
TARGET_AVX2 static inline __attribute__((always_inline)) void finish4_bf16(const float *x, const uint16_t *w,
                                                                           Py_ssize_t n, Py_ssize_t step, Py_ssize_t i,
                                                                           float *s, float *y) {
    for (; i < n; i++)
        for (int k = 0; k < 4; k++) s[k] += x[i] * bf16_to_float(w[k * step * n + i]);
    for (int k = 0; k < 4; k++) y[k * step] = s[k];
}

/* bf16 without widening: a 256-bit load holds 16 bf16 as 8 pairs; shifted left 16 each pair's first element is a
 * float32, masked to the high half its second one. x's 16 floats are split into evens and odds once for the four rows
 * (shuffle, then a quad permute to undo the per-lane order), and each row keeps an even and an odd accumulator. */
TARGET_AVX2 static void dot4_bf16_avx2(const float *x, const uint16_t *w, Py_ssize_t n, Py_ssize_t step, float *y) {
    const uint16_t *w0 = w, *w1 = w + step * n, *w2 = w + 2 * step * n, *w3 = w + 3 * step * n;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 xa = _mm256_loadu_ps(x + i), xb = _mm256_loadu_ps(x + i + 8);
        const __m256 xe = _mm256_castpd_ps(_mm256_permute4x64_pd(
            _mm256_castps_pd(_mm256_shuffle_ps(xa, xb, _MM_SHUFFLE(2, 0, 2, 0))), 0xD8));
        const __m256 xo = _mm256_castpd_ps(_mm256_permute4x64_pd(
            _mm256_castps_pd(_mm256_shuffle_ps(xa, xb, _MM_SHUFFLE(3, 1, 3, 1))), 0xD8));
#define BF16_PAIRS(wk, e, o)                                                                                       \
    do {                                                                                                           \
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wk + i));                                           \
        e = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xe, e);                                 \
        o = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), xo, o);                               \
    } while (0)
        BF16_PAIRS(w0, e0, o0);
        BF16_PAIRS(w1, e1, o1);
        BF16_PAIRS(w2, e2, o2);
        BF16_PAIRS(w3, e3, o3);
#undef BF16_PAIRS
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        e0 = _mm256_fmadd_ps(load_bf16(w0 + i), xv, e0);
        e1 = _mm256_fmadd_ps(load_bf16(w1 + i), xv, e1);
        e2 = _mm256_fmadd_ps(load_bf16(w2 + i), xv, e2);
        e3 = _mm256_fmadd_ps(load_bf16(w3 + i), xv, e3);
    }
    float s[4] = {hsum8(_mm256_add_ps(e0, o0)), hsum8(_mm256_add_ps(e1, o1)), hsum8(_mm256_add_ps(e2, o2)),
                  hsum8(_mm256_add_ps(e3, o3))};
    finish4_bf16(x, w, n, step, i, s, y);
}

/* The same pairs on AVX-512: 32 bf16 a step in one 512-bit load, x's 32 floats split into evens and odds by one
 * two-source permute each; a last step of 16 widens (as load_bf16 does) and the last n % 16 are scalar. */
TARGET_AVX512 static void dot4_bf16_avx512(const float *x, const uint16_t *w, Py_ssize_t n, Py_ssize_t step, float *y) {
    const uint16_t *w0 = w, *w1 = w + step * n, *w2 = w + 2 * step * n, *w3 = w + 3 * step * n;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 xa = _mm512_loadu_ps(x + i), xb = _mm512_loadu_ps(x + i + 16);
        const __m512 xe = _mm512_permutex2var_ps(xa, evens, xb), xo = _mm512_permutex2var_ps(xa, odds, xb);
#define BF16_PAIRS_Z(wk, e, o)                                                                                     \
    do {                                                                                                           \
        const __m512i v = _mm512_loadu_si512((const void *)(wk + i));                                              \
        e = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), xe, e);                                 \
        o = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), xo, o);                               \
    } while (0)
        BF16_PAIRS_Z(w0, e0, o0);
        BF16_PAIRS_Z(w1, e1, o1);
        BF16_PAIRS_Z(w2, e2, o2);
        BF16_PAIRS_Z(w3, e3, o3);
#undef BF16_PAIRS_Z
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        e0 = _mm512_fmadd_ps(load16_bf16(w0 + i), xv, e0);
        e1 = _mm512_fmadd_ps(load16_bf16(w1 + i), xv, e1);
        e2 = _mm512_fmadd_ps(load16_bf16(w2 + i), xv, e2);
        e3 = _mm512_fmadd_ps(load16_bf16(w3 + i), xv, e3);
    }
    float s[4] = {_mm512_reduce_add_ps(_mm512_add_ps(e0, o0)), _mm512_reduce_add_ps(_mm512_add_ps(e1, o1)),
                  _mm512_reduce_add_ps(_mm512_add_ps(e2, o2)), _mm512_reduce_add_ps(_mm512_add_ps(e3, o3))};
    finish4_bf16(x, w, n, step, i, s, y);
}

TARGET_AVX2 static void dot4_f16_avx2(const float *x, const uint16_t *w, Py_ssize_t n, Py_ssize_t step, float *y) {
    DOT4_BODY(uint16_t, load_f16, _cvtsh_ss)
}

/* Four float32 weight rows (stride n) against two x rows: 8 products share each load (prefill, m > 1). */
TARGET_AVX2 static void dot4x2_f32_avx2(const float *xa, const float *xb, const float *w, Py_ssize_t n, float *ya,
                                        float *yb) {
    const float *w0 = w, *w1 = w + n, *w2 = w + 2 * n, *w3 = w + 3 * n;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 va = _mm256_loadu_ps(xa + i), vb = _mm256_loadu_ps(xb + i);
        const __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
        a0 = _mm256_fmadd_ps(v0, va, a0);
        b0 = _mm256_fmadd_ps(v0, vb, b0);
        a1 = _mm256_fmadd_ps(v1, va, a1);
        b1 = _mm256_fmadd_ps(v1, vb, b1);
        const __m256 v2 = _mm256_loadu_ps(w2 + i), v3 = _mm256_loadu_ps(w3 + i);
        a2 = _mm256_fmadd_ps(v2, va, a2);
        b2 = _mm256_fmadd_ps(v2, vb, b2);
        a3 = _mm256_fmadd_ps(v3, va, a3);
        b3 = _mm256_fmadd_ps(v3, vb, b3);
    }
    float sa[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
    float sb[4] = {hsum8(b0), hsum8(b1), hsum8(b2), hsum8(b3)};
    for (; i < n; i++)
        for (int k = 0; k < 4; k++) {
            sa[k] += xa[i] * w[k * n + i];
            sb[k] += xb[i] * w[k * n + i];
        }
    memcpy(ya, sa, sizeof sa);
    memcpy(yb, sb, sizeof sb);
}

/* Four float32 weight rows (stride n) against three x rows (stride n): 12 sums in registers, 7 loads per 12 products
 * (prefill). Each sum is the same operations in the same order as dot4x2_f32_avx2's and dot4_f32_avx2's (one 8-lane
 * accumulator front to back, hsum8, the tail in order), so an output does not depend on which of them computed it. */
TARGET_AVX2 static void dot4x3_f32_avx2(const float *x, const float *w, Py_ssize_t n, float *y, Py_ssize_t out) {
    const float *w0 = w, *w1 = w + n, *w2 = w + 2 * n, *w3 = w + 3 * n;
    const float *xa = x, *xb = x + n, *xc = x + 2 * n;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
        const __m256 v2 = _mm256_loadu_ps(w2 + i), v3 = _mm256_loadu_ps(w3 + i);
        __m256 u = _mm256_loadu_ps(xa + i);
        a0 = _mm256_fmadd_ps(v0, u, a0);
        a1 = _mm256_fmadd_ps(v1, u, a1);
        a2 = _mm256_fmadd_ps(v2, u, a2);
        a3 = _mm256_fmadd_ps(v3, u, a3);
        u = _mm256_loadu_ps(xb + i);
        b0 = _mm256_fmadd_ps(v0, u, b0);
        b1 = _mm256_fmadd_ps(v1, u, b1);
        b2 = _mm256_fmadd_ps(v2, u, b2);
        b3 = _mm256_fmadd_ps(v3, u, b3);
        u = _mm256_loadu_ps(xc + i);
        c0 = _mm256_fmadd_ps(v0, u, c0);
        c1 = _mm256_fmadd_ps(v1, u, c1);
        c2 = _mm256_fmadd_ps(v2, u, c2);
        c3 = _mm256_fmadd_ps(v3, u, c3);
    }
    float s[3][4] = {{hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)}, {hsum8(b0), hsum8(b1), hsum8(b2), hsum8(b3)},
                     {hsum8(c0), hsum8(c1), hsum8(c2), hsum8(c3)}};
    for (; i < n; i++)
        for (int k = 0; k < 4; k++) {
            s[0][k] += xa[i] * w[k * n + i];
            s[1][k] += xb[i] * w[k * n + i];
            s[2][k] += xc[i] * w[k * n + i];
        }
    for (int t = 0; t < 3; t++) memcpy(y + t * out, s[t], sizeof s[t]);
}

/* 8 float8_e4m3fn bytes -> 8 floats / 256: the 7 exponent+mantissa bits placed in a float16 are the value times
 * 2^-8 (normal and subnormal alike: the biases differ by 8); NaN (0x7F/0xFF) is kept NaN. */
TARGET_AVX2 static inline __m256 load_fp8_div256(const uint8_t *p) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i em = _mm_and_si128(b, _mm_set1_epi16(0x7F));
    __m128i h = _mm_or_si128(_mm_slli_epi16(em, 7), _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(em, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7E00)));
    return _mm256_cvtph_ps(h);
}

TARGET_AVX2 static float dot_fp8_avx2(const float *x, const uint8_t *w, const float *s, Py_ssize_t n,
                                      Py_ssize_t b1) {
    __m256 total = _mm256_setzero_ps();
    float tail = 0.0f;
    for (Py_ssize_t c0 = 0, cb = 0; c0 < n; c0 += b1, cb++) {
        const Py_ssize_t c1 = c0 + b1 < n ? c0 + b1 : n;
        __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
        Py_ssize_t i = c0;
        for (; i + 16 <= c1; i += 16) {
            p0 = _mm256_fmadd_ps(load_fp8_div256(w + i), _mm256_loadu_ps(x + i), p0);
            p1 = _mm256_fmadd_ps(load_fp8_div256(w + i + 8), _mm256_loadu_ps(x + i + 8), p1);
        }
        for (; i + 8 <= c1; i += 8) p0 = _mm256_fmadd_ps(load_fp8_div256(w + i), _mm256_loadu_ps(x + i), p0);
        total = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(s[cb] * 256.0f), total);
        float t = 0.0f;
        for (; i < c1; i++) t += x[i] * fp8_table[w[i]];
        tail += t * s[cb];
    }
    return hsum8(total) + tail;
}

TARGET_AVX2 static inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* One block of 32 int8 weights (lo: elements 0..15, hi: 16..31) times x's 32 floats, times the block's scale, added
 * to the accumulator of the block's parity (two chains hide the FMA latency). */
TARGET_AVX2 static inline void fma_block_i8(__m128i lo, __m128i hi, const float *xb, float scale, Py_ssize_t b,
                                            __m256 *t0, __m256 *t1) {
    __m256 p0 = _mm256_mul_ps(i8x8_to_ps(lo), _mm256_loadu_ps(xb));
    __m256 p1 = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xb + 8));
    p0 = _mm256_fmadd_ps(i8x8_to_ps(hi), _mm256_loadu_ps(xb + 16), p0);
    p1 = _mm256_fmadd_ps(i8x8_to_ps(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xb + 24), p1);
    __m256 *t = (b & 1) ? t1 : t0;
    *t = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(scale), *t);
}

TARGET_AVX2 static float dot_q8_avx2(const float *x, const int8_t *w, const uint16_t *d, Py_ssize_t n) {
    __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < n / QBLOCK; b++) {
        const int8_t *wb = w + b * QBLOCK;
        __m128i lo = _mm_loadu_si128((const __m128i *)wb), hi = _mm_loadu_si128((const __m128i *)(wb + 16));
        fma_block_i8(lo, hi, x + b * QBLOCK, _cvtsh_ss(d[b]), b, &t0, &t1);
    }
    return hsum8(_mm256_add_ps(t0, t1));
}

TARGET_AVX2 static float dot_q4_avx2(const float *x, const uint8_t *w, const uint16_t *d, Py_ssize_t n) {
    __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    for (Py_ssize_t b = 0; b < n / QBLOCK; b++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(w + b * (QBLOCK / 2)));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(v, mask), eight);                     /* elements 0..15 */
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), eight);  /* elements 16..31 */
        fma_block_i8(lo, hi, x + b * QBLOCK, _cvtsh_ss(d[b]), b, &t0, &t1);
    }
    return hsum8(_mm256_add_ps(t0, t1));
}

/* 8 FP4 E2M1 codes (one per byte of an __m128i's low 8 bytes) -> 8 floats: the magnitude from a permute of the
 * 8-entry table (it reads the code's low 3 bits), the sign from bit 3. */
TARGET_AVX2 static inline __m256 fp4x8_to_ps(__m128i codes, __m256 table) {
    __m256i c = _mm256_cvtepu8_epi32(codes);
    __m256 mag = _mm256_permutevar8x32_ps(table, c);
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28)));
}

TARGET_AVX2 static float dot_mxfp4_avx2(const float *x, const uint8_t *w, const uint8_t *e, Py_ssize_t n) {
    const __m256 table = _mm256_loadu_ps(fp4_table);
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < n / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        __m128i v = _mm_loadu_si128((const __m128i *)(w + b * (QBLOCK / 2)));
        __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi); /* elements 0..15, 16..31 */
        __m256 p0 = _mm256_mul_ps(fp4x8_to_ps(c0, table), _mm256_loadu_ps(xb));
        __m256 p1 = _mm256_mul_ps(fp4x8_to_ps(_mm_srli_si128(c0, 8), table), _mm256_loadu_ps(xb + 8));
        p0 = _mm256_fmadd_ps(fp4x8_to_ps(c1, table), _mm256_loadu_ps(xb + 16), p0);
        p1 = _mm256_fmadd_ps(fp4x8_to_ps(_mm_srli_si128(c1, 8), table), _mm256_loadu_ps(xb + 24), p1);
        __m256 scale = _mm256_set1_ps(e8m0_to_float(e[b]));
        if (b & 1)
            t1 = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), scale, t1);
        else
            t0 = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), scale, t0);
    }
    return hsum8(_mm256_add_ps(t0, t1));
}

/* x [n] -> int16 [n] and a power-of-two scale per block of 32: xq = round(x * 2^k), k the largest with the block's
 * largest |x| * 2^k < 2^15 (saturated to +-32767), xs = 2^-k. Returns -1 (x not finite, or a block's largest |x| at
 * least 2^18) if the float kernels must run instead: with xs <= 2^3 a block's scale times xs stays finite (MXFP4's
 * largest accepted scale 2^125 * 0.5 * 2^3 = 2^127, float16's 65504 * 2^3), so a block of zero weights gives 0 as in
 * the reference, never 0 * inf = NaN. */
TARGET_AVX2 static int quantize_x16(const float *x, Py_ssize_t n, int16_t *xq, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    for (Py_ssize_t b = 0; b < n / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        __m256 v[4], amax = _mm256_setzero_ps();
        int finite = 0xFF;
        for (int c = 0; c < 4; c++) {
            v[c] = _mm256_loadu_ps(xb + 8 * c);
            const __m256 a = _mm256_andnot_ps(sign, v[c]);
            finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ)); /* false for inf and NaN */
            amax = _mm256_max_ps(amax, a);
        }
        if (finite != 0xFF) return -1;
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float top = _mm_cvtss_f32(m4);
        if (top >= 262144.0f) return -1;
        if (top == 0.0f) {
            memset(xq + b * QBLOCK, 0, QBLOCK * sizeof(int16_t));
            xs[b] = 0.0f;
            continue;
        }
        int e;
        frexpf(top, &e); /* top < 2^e */
        const int k = 15 - e;
        if (k > 126 || k < -126) { /* 2^k or 2^-k is not a normal float: the exact, slow way */
            for (int i = 0; i < QBLOCK; i++) {
                float q = rintf(ldexpf(xb[i], k));
                xq[b * QBLOCK + i] = (int16_t)(q > 32767.0f ? 32767 : q < -32767.0f ? -32767 : q);
            }
            xs[b] = ldexpf(1.0f, -k);
            continue;
        }
        const __m256 up = _mm256_set1_ps(ldexpf(1.0f, k)); /* exact: a power of two */
        for (int c = 0; c < 4; c += 2) {
            /* round to nearest even (the default rounding), then pack with saturation (32768 -> 32767) */
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], up));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[c + 1], up));
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
            _mm256_storeu_si256((__m256i *)(xq + b * QBLOCK + 8 * c), packed);
        }
        xs[b] = ldexpf(1.0f, -k);
    }
    return 0;
}

/* One-row q8, q4 and mxfp4 products with an int16 x (a decode step). A block's 32 weights are widened to int16
 * sixteen at a time (256-bit) and multiplied with x's block by two madd; the two halves of their eight lane sums are
 * added into four exact int32 lane sums, lane j summing elements 8q + 2j and 8q + 2j + 1 (q < 4): the integers of
 * eight at a time with 128-bit operations, in half the widenings and madds (on a 2-vCPU AMD EPYC without AVX-512, an
 * int8 model's moe_row 0.79-0.83 -> 0.71-0.78 ms a token on 1 thread, 0.54-0.63 -> 0.49-0.51 on 2; int4 0.85-0.88 ->
 * 0.73-0.74 and 0.55-0.60 -> 0.46-0.49). Those sums, converted to float, are scaled by the block's scale times xs into
 * the row's accumulator; the scales are formed eight blocks at a time into a small array and broadcast from there.
 * `DOT_X16_ROWS` runs ROWS weight rows against each x block as it is loaded: four for most rows, one for the
 * leftovers, each row's operations in the same order, so the results are bit-identical whatever the grouping. Each
 * weight row is prefetched X16_PREFETCH bytes beyond its reads (a hint, which never faults), so memory is read while
 * the blocks before it are multiplied: further down the row's own stream, since run_rows reads the rows as four
 * quarters, each front to back. (When four adjacent rows were read together, the prefetch had to reach the next four
 * rows, 4 row lengths on, to help; one group ahead took a 2048 x 1024 q8 product from 367 to 266 us, weights streamed
 * from memory, 1 thread. A longer reach, one or four rows further, measured no faster with quarters.) */
#define X16_PREFETCH 2048

/* A block's weights widened to int16, elements 0..15 (w0) and 16..31 (w1), against x's block (x0..x3: elements
 * 0..7, 8..15, 16..23, 24..31): the four int32 lane sums, lane j summing elements 8q + 2j and 8q + 2j + 1. */
TARGET_AVX2 static inline __attribute__((always_inline)) __m128i madd_block(__m256i w0, __m256i w1, __m128i x0,
                                                                            __m128i x1, __m128i x2, __m128i x3) {
    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_set_m128i(x1, x0)),
                                       _mm256_madd_epi16(w1, _mm256_set_m128i(x3, x2)));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* Block b of q8 row w against x's block: four int32 sums. */
TARGET_AVX2 static inline __attribute__((always_inline)) __m128i block_q8_x16(const void *w, Py_ssize_t b, __m128i x0,
                                                                              __m128i x1, __m128i x2, __m128i x3,
                                                                              const int32_t *xc) {
    const int8_t *p = (const int8_t *)w + b * QBLOCK;
    (void)xc;
    return madd_block(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
                      _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16))), x0, x1, x2, x3);
}

/* The same for q4: byte i of the block holds element i (low nibble) and element 16 + i (high nibble), each + 8.
 * The nibbles are multiplied as they are (0..15) and xc[4b..4b+4), whose lanes sum to 8 * the sum of x's block,
 * subtracted: the same integers as with the nibbles minus 8, in fewer operations. */
TARGET_AVX2 static inline __attribute__((always_inline)) __m128i block_q4_x16(const void *w, Py_ssize_t b, __m128i x0,
                                                                              __m128i x1, __m128i x2, __m128i x3,
                                                                              const int32_t *xc) {
    const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)w + b * (QBLOCK / 2))));
    const __m128i sum = madd_block(_mm256_and_si256(u, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(u, 4), x0, x1, x2,
                                   x3); /* low nibbles: elements 0..15, high: 16..31 */
    return _mm_sub_epi32(sum, _mm_loadu_si128((const __m128i *)(xc + 4 * b)));
}

/* The same for MXFP4: byte i of the block holds element 2i (low nibble) and 2i + 1 (high nibble) as FP4 E2M1
 * codes; each code's value times 2 is a small integer (a table look-up with pshufb), the block's scale halves it.
 * mxfp4_twice: block b's 32 doubled values as int8, in element order (c0: elements 0..15, c1: 16..31). */
TARGET_AVX2 static inline __attribute__((always_inline)) void mxfp4_twice(const void *w, Py_ssize_t b, __m128i *c0,
                                                                          __m128i *c1) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i twice = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i v = _mm_loadu_si128((const __m128i *)((const uint8_t *)w + b * (QBLOCK / 2)));
    const __m128i lo = _mm_shuffle_epi8(twice, _mm_and_si128(v, mask));                    /* elements 0, 2, .. */
    const __m128i hi = _mm_shuffle_epi8(twice, _mm_and_si128(_mm_srli_epi16(v, 4), mask)); /* elements 1, 3, .. */
    *c0 = _mm_unpacklo_epi8(lo, hi); /* elements 0..15 */
    *c1 = _mm_unpackhi_epi8(lo, hi); /* elements 16..31 */
}

TARGET_AVX2 static inline __attribute__((always_inline)) __m128i block_mxfp4_x16(const void *w, Py_ssize_t b,
                                                                                 __m128i x0, __m128i x1, __m128i x2,
                                                                                 __m128i x3, const int32_t *xc) {
    __m128i c0, c1;
    mxfp4_twice(w, b, &c0, &c1);
    (void)xc;
    return madd_block(_mm256_cvtepi8_epi16(c0), _mm256_cvtepi8_epi16(c1), x0, x1, x2, x3);
}

/* sc[i] = d[b + i] * xs[b + i] for the blocks [b, min(b + 8, nb)), d float16 (q8, q4). */
TARGET_AVX2 static inline __attribute__((always_inline)) void scales_f16(const void *dp, const float *xs, Py_ssize_t b,
                                                                         Py_ssize_t nb, float *sc) {
    const uint16_t *d = (const uint16_t *)dp;
    if (b + 8 <= nb) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        _mm256_storeu_ps(sc, _mm256_mul_ps(dv, _mm256_loadu_ps(xs + b)));
        return;
    }
    for (Py_ssize_t i = 0; b + i < nb; i++) sc[i] = _cvtsh_ss(d[b + i]) * xs[b + i];
}

/* The same for MXFP4's E8M0 scale bytes, halved (block_mxfp4_x16 takes twice the codes' values). */
TARGET_AVX2 static inline __attribute__((always_inline)) void scales_e8m0(const void *dp, const float *xs,
                                                                          Py_ssize_t b, Py_ssize_t nb, float *sc) {
    const uint8_t *e = (const uint8_t *)dp;
    for (Py_ssize_t i = 0; i < 8 && b + i < nb; i++) sc[i] = e8m0_to_float(e[b + i]) * 0.5f * xs[b + i];
}

TARGET_AVX2 static inline float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* In DOT_X16_ROWS and DOT_Z16_ROWS, before blocks [c, c + 8) of each row k: their scales times x's into sc[k], and
 * the row's lines X16_PREFETCH bytes on prefetched. */
#define EIGHT_BLOCKS_AHEAD(SCALES, ROWS, ROW_BYTES)                                                              \
    _Pragma("GCC unroll 4") for (int k = 0; k < ROWS; k++) {                                                     \
        SCALES(d[k], xs, c, nb, sc[k]);                                                                          \
        for (int line = 0; line < 8 * (ROW_BYTES) / 64; line++)                                                  \
            _mm_prefetch((const char *)w[k] + c * (ROW_BYTES) + X16_PREFETCH + 64 * line, _MM_HINT_T0);         \
    }

/* y[k] = row k's product, k < ROWS, for weight rows w[k] (ROW_BYTES bytes a block) with float16 block scales d[k];
 * nb blocks of 32; xc: q4's corrections (see block_q4_x16; NULL for q8). */
#define DOT_X16_ROWS(NAME, BLOCK, SCALES, ROWS, ROW_BYTES)                                                        \
    TARGET_AVX2 static void NAME(const int16_t *xq, const float *xs, const int32_t *xc, const void *const *w,   \
                                 const void *const *d, Py_ssize_t nb, float *y, Py_ssize_t step) {              \
        __m128 acc[ROWS];                                                                                        \
        float sc[ROWS][8];                                                                                       \
        _Pragma("GCC unroll 4") for (int k = 0; k < ROWS; k++) acc[k] = _mm_setzero_ps();                       \
        for (Py_ssize_t c = 0; c < nb; c += 8) {                                                                 \
            const Py_ssize_t cn = nb - c < 8 ? nb - c : 8;                                                       \
            EIGHT_BLOCKS_AHEAD(SCALES, ROWS, ROW_BYTES);                                                         \
            for (Py_ssize_t i = 0; i < cn; i++) {                                                                \
                const Py_ssize_t b = c + i;                                                                      \
                const __m128i x0 = _mm_loadu_si128((const __m128i *)(xq + b * QBLOCK));                          \
                const __m128i x1 = _mm_loadu_si128((const __m128i *)(xq + b * QBLOCK + 8));                      \
                const __m128i x2 = _mm_loadu_si128((const __m128i *)(xq + b * QBLOCK + 16));                     \
                const __m128i x3 = _mm_loadu_si128((const __m128i *)(xq + b * QBLOCK + 24));                     \
                _Pragma("GCC unroll 4") for (int k = 0; k < ROWS; k++)                                           \
                    acc[k] = _mm_fmadd_ps(_mm_cvtepi32_ps(BLOCK(w[k], b, x0, x1, x2, x3, xc)),                  \
                                          _mm_broadcast_ss(&sc[k][i]), acc[k]);                                  \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 4") for (int k = 0; k < ROWS; k++) y[k * step] = hsum4(acc[k]);                     \
    }

DOT_X16_ROWS(dot4_q8_x16, block_q8_x16, scales_f16, 4, QBLOCK)
DOT_X16_ROWS(dot1_q8_x16, block_q8_x16, scales_f16, 1, QBLOCK)
DOT_X16_ROWS(dot4_q4_x16, block_q4_x16, scales_f16, 4, QBLOCK / 2)
DOT_X16_ROWS(dot1_q4_x16, block_q4_x16, scales_f16, 1, QBLOCK / 2)
DOT_X16_ROWS(dot4_mxfp4_x16, block_mxfp4_x16, scales_e8m0, 4, QBLOCK / 2)
DOT_X16_ROWS(dot1_mxfp4_x16, block_mxfp4_x16, scales_e8m0, 1, QBLOCK / 2)

/* The same products with AVX-512: a block's 32 weights widened to 32 int16 in one 512-bit register and multiplied with
 * x's block by one madd (sixteen exact int32 sums of two products each: |sum| <= 2 * 128 * 32768 = 2^24 for q8, so
 * exact as floats), converted and scaled into a 16-lane accumulator. About a third of the AVX2 kernels' instructions
 * a block.
 * The integer sums are the same as on AVX2; the float accumulation groups them differently (16 lanes, not 4), so the
 * two ISAs agree within float32 rounding, not bit for bit; each is deterministic, and four rows or one give the same
 * bits. */
TARGET_AVX512 static inline __attribute__((always_inline)) __m512i zblock_q8(const void *w, Py_ssize_t b) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)w + b * QBLOCK)));
}

/* q4 (see block_q4_x16): low nibbles are elements 0..15, high nibbles 16..31, each minus 8. */
TARGET_AVX512 static inline __attribute__((always_inline)) __m512i zblock_q4(const void *w, Py_ssize_t b) {
    const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)w + b * (QBLOCK / 2))));
    const __m256i low = _mm256_set1_epi16(0x0F), eight = _mm256_set1_epi16(8);
    const __m256i lo = _mm256_sub_epi16(_mm256_and_si256(u, low), eight); /* elements 0..15 */
    const __m256i hi = _mm256_sub_epi16(_mm256_srli_epi16(u, 4), eight);  /* 16..31 */
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* MXFP4 (see block_mxfp4_x16): twice each code's value, in element order. */
TARGET_AVX512 static inline __attribute__((always_inline)) __m512i zblock_mxfp4(const void *w, Py_ssize_t b) {
    __m128i c0, c1;
    mxfp4_twice(w, b, &c0, &c1);
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(c0), c1, 1)); /* elements 0..31 */
}

#define DOT_Z16_ROWS(NAME, BLOCK, SCALES, ROWS, ROW_BYTES)                                                        \
    TARGET_AVX512 static void NAME(const int16_t *xq, const float *xs, const void *const *w, const void *const *d, \
                                   Py_ssize_t nb, float *y, Py_ssize_t step) {                                 \
        __m512 acc[ROWS];                                                                                        \
        float sc[ROWS][8];                                                                                       \
        _Pragma("GCC unroll 4") for (int k = 0; k < ROWS; k++) acc[k] = _mm512_setzero_ps();                    \
        for (Py_ssize_t c = 0; c < nb; c += 8) {                                                                 \
            const Py_ssize_t cn = nb - c < 8 ? nb - c : 8;                                                       \
            EIGHT_BLOCKS_AHEAD(SCALES, ROWS, ROW_BYTES);                                                         \
            for (Py_ssize_t i = 0; i < cn; i++) {                                                                \
                const Py_ssize_t b = c + i;                                                                      \
                const __m512i xv = _mm512_loadu_si512((const void *)(xq + b * QBLOCK));                          \
                _Pragma("GCC unroll 4") for (int k = 0; k < ROWS; k++)                                           \
                    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(BLOCK(w[k], b), xv)),          \
                                             _mm512_set1_ps(sc[k][i]), acc[k]);                                  \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 4") for (int k = 0; k < ROWS; k++) y[k * step] = _mm512_reduce_add_ps(acc[k]);      \
    }

DOT_Z16_ROWS(dot4_q8_z16, zblock_q8, scales_f16, 4, QBLOCK)
DOT_Z16_ROWS(dot1_q8_z16, zblock_q8, scales_f16, 1, QBLOCK)
DOT_Z16_ROWS(dot4_q4_z16, zblock_q4, scales_f16, 4, QBLOCK / 2)
DOT_Z16_ROWS(dot1_q4_z16, zblock_q4, scales_f16, 1, QBLOCK / 2)
DOT_Z16_ROWS(dot4_mxfp4_z16, zblock_mxfp4, scales_e8m0, 4, QBLOCK / 2)
DOT_Z16_ROWS(dot1_mxfp4_z16, zblock_mxfp4, scales_e8m0, 1, QBLOCK / 2)

/* Rows r + k step (k < rows) of a q8, q4 or mxfp4 job with an int16 x (j->xq set), rows 4 or 1, on AVX-512 where
 * the job has it. */
TARGET_AVX2 static void dot_quant_x16(const job_t *j, Py_ssize_t r, int rows, Py_ssize_t step) {
    const Py_ssize_t n = j->in, nb = n / QBLOCK;
    const Py_ssize_t row_bytes = j->kind == K_Q8 ? n : n / 2;
    const Py_ssize_t scale_bytes = j->kind == K_MXFP4 ? nb : 2 * nb; /* a row's: E8M0 bytes or float16 */
    const uint8_t *w = (const uint8_t *)j->w + r * row_bytes;
    const uint8_t *d = (const uint8_t *)j->scale + r * scale_bytes;
    const Py_ssize_t wk = step * row_bytes, dk = step * scale_bytes;
    const void *const ws[4] = {w, w + wk, w + 2 * wk, w + 3 * wk};
    const void *const ds[4] = {d, d + dk, d + 2 * dk, d + 3 * dk};
    if (j->simd == SIMD_AVX512) {
        if (j->kind == K_Q8)
            (rows == 4 ? dot4_q8_z16 : dot1_q8_z16)(j->xq, j->xs, ws, ds, nb, j->y + r, step);
        else if (j->kind == K_Q4)
            (rows == 4 ? dot4_q4_z16 : dot1_q4_z16)(j->xq, j->xs, ws, ds, nb, j->y + r, step);
        else
            (rows == 4 ? dot4_mxfp4_z16 : dot1_mxfp4_z16)(j->xq, j->xs, ws, ds, nb, j->y + r, step);
        return;
    }
    if (j->kind == K_Q8)
        (rows == 4 ? dot4_q8_x16 : dot1_q8_x16)(j->xq, j->xs, NULL, ws, ds, nb, j->y + r, step);
    else if (j->kind == K_Q4)
        (rows == 4 ? dot4_q4_x16 : dot1_q4_x16)(j->xq, j->xs, j->xc, ws, ds, nb, j->y + r, step);
    else
        (rows == 4 ? dot4_mxfp4_x16 : dot1_mxfp4_x16)(j->xq, j->xs, NULL, ws, ds, nb, j->y + r, step);
}

/* One weight row's product with one x row, in the stored dtype. */
TARGET_AVX2 static float dot_row_avx2(const job_t *j, Py_ssize_t r, const float *x) {
    const Py_ssize_t n = j->in;
    switch (j->kind) {
    case K_F32:
        return dot_f32_avx2(x, (const float *)j->w + r * n, n);
    case K_F16:
        return dot_f16_avx2(x, (const uint16_t *)j->w + r * n, n);
    case K_BF16:
        return dot_bf16_avx2(x, (const uint16_t *)j->w + r * n, n);
    case K_FP8:
        return dot_fp8_avx2(x, (const uint8_t *)j->w + r * n,
                            (const float *)j->scale + (r / j->b0) * ((n + j->b1 - 1) / j->b1), n, j->b1);
    case K_Q8:
        return dot_q8_avx2(x, (const int8_t *)j->w + r * n, (const uint16_t *)j->scale + r * (n / QBLOCK), n);
    case K_Q4:
        return dot_q4_avx2(x, (const uint8_t *)j->w + r * (n / 2), (const uint16_t *)j->scale + r * (n / QBLOCK), n);
    default:
        return dot_mxfp4_avx2(x, (const uint8_t *)j->w + r * (n / 2), (const uint8_t *)j->scale + r * (n / QBLOCK),
                              n);
    }
}

#endif /* HAVE_X86_KERNELS */

/* Output rows [r0, r1) of the job. Returns -1 if a scratch row could not be allocated. */
static int run_rows(const job_t *j, Py_ssize_t r0, Py_ssize_t r1) {
    const Py_ssize_t m = j->m, n = j->in, out = j->out;
#if HAVE_X86_KERNELS
    if (j->simd && m == 1) {
        Py_ssize_t r = r0;
        /* Every kind's rows in four quarters, each read front to back as one stream, the four-row kernel taking a
         * row of each at a time (r0 + t + k q); the rest (r1 - r0 not a multiple of 4) one by one. Four adjacent
         * rows at a time made four streams as short as a row (2 KiB in a [1024, 512] float32 expert), which the
         * hardware prefetcher barely follows before they end. */
        const Py_ssize_t q = (r1 - r0) / 4;
        if (j->kind == K_F32) {
            for (Py_ssize_t t = 0; t < q; t++)
                (j->simd == SIMD_AVX512 ? dot4_f32_avx512 : dot4_f32_avx2)(j->x, (const float *)j->w + (r0 + t) * n, n,
                                                                           q, j->y + r0 + t);
            r += 4 * q;
        } else if (j->kind == K_BF16) {
            for (Py_ssize_t t = 0; t < q; t++)
                (j->simd == SIMD_AVX512 ? dot4_bf16_avx512 : dot4_bf16_avx2)(
                    j->x, (const uint16_t *)j->w + (r0 + t) * n, n, q, j->y + r0 + t);
            r += 4 * q;
        } else if (j->kind == K_F16) {
            for (Py_ssize_t t = 0; t < q; t++)
                (j->simd == SIMD_AVX512 ? dot4_f16_avx512 : dot4_f16_avx2)(j->x, (const uint16_t *)j->w + (r0 + t) * n,
                                                                           n, q, j->y + r0 + t);
            r += 4 * q;
        } else if (j->xq) { /* q8, q4, mxfp4 */
            for (Py_ssize_t t = 0; t < q; t++) dot_quant_x16(j, r0 + t, 4, q);
            for (r += 4 * q; r < r1; r++) dot_quant_x16(j, r, 1, 1);
        }
        for (; r < r1; r++) j->y[r] = dot_row_avx2(j, r, j->x);
        return 0;
    }
#endif
    float *row = NULL;
    if (j->kind != K_F32) {
        row = (float *)malloc((size_t)n * 4 * sizeof(float));
        if (!row) return -1;
    }
    Py_ssize_t r = r0;
#if HAVE_X86_KERNELS
    /* several x rows: four weight rows at a time (decoded to float32 unless stored so), three x rows per pass. A
     * float32 weight's rows are read in place, so x is taken in tiles that stay in L1 (X_TILE_BYTES) while the
     * chunk's weight rows pass over each: with all of x per four weight rows, x (67 rows of 4 KiB for a [512, 1024]
     * expert's down product) streamed from L2 at every pass, and a 67-row SwiGLU expert ran at a third of the
     * speed per row of an 8-row one. A decoded weight keeps one pass over all of x (each row decoded once). */
    if (j->simd) {
        const Py_ssize_t r4 = r0 + (r1 - r0) / 4 * 4;
        Py_ssize_t tile = row ? m : X_TILE_BYTES / (n * (Py_ssize_t)sizeof(float)) / 3 * 3;
        if (tile < 3) tile = 3;
        for (Py_ssize_t i0 = 0; i0 < m; i0 += tile) {
            const Py_ssize_t i1 = i0 + tile < m ? i0 + tile : m;
            for (r = r0; r < r4; r += 4) {
                const float *w4 = (const float *)j->w + r * n;
                if (row) {
                    for (int k = 0; k < 4; k++) decode_row(j, r + k, row + k * n);
                    w4 = row;
                }
                Py_ssize_t i = i0;
                for (; i + 3 <= i1; i += 3) dot4x3_f32_avx2(j->x + i * n, w4, n, j->y + i * out + r, out);
                for (; i + 2 <= i1; i += 2)
                    dot4x2_f32_avx2(j->x + i * n, j->x + (i + 1) * n, w4, n, j->y + i * out + r,
                                    j->y + (i + 1) * out + r);
                for (; i < i1; i++) dot4_f32_avx2(j->x + i * n, w4, n, 1, j->y + i * out + r);
            }
        }
        r = r4;
    }
#endif
    for (; r < r1; r++) {
        const float *wr = (const float *)j->w + r * n;
        if (row) {
            decode_row(j, r, row);
            wr = row;
        }
        for (Py_ssize_t i = 0; i < m; i++) {
#if HAVE_X86_KERNELS
            if (j->simd) {
                j->y[i * out + r] = dot_f32_avx2(j->x + i * n, wr, n);
                continue;
            }
#endif
            j->y[i * out + r] = dot_plain(j->x + i * n, wr, n);
        }
    }
    free(row);
    return 0;
}

static void silu_mul(float *g, const float *u, Py_ssize_t n);

/* Output rows [r0, r1) of the job and, for a gate job, of its up job, then silu(gate) * up on those rows of every x
 * row. Returns -1 if a scratch row could not be allocated. */
static int run_chunk(const job_t *j, Py_ssize_t r0, Py_ssize_t r1) {
    if (run_rows(j, r0, r1)) return -1;
    if (!j->up) return 0;
    if (run_rows(j->up, r0, r1)) return -1;
    for (Py_ssize_t i = 0; i < j->m; i++) silu_mul(j->y + i * j->out + r0, j->up->y + i * j->out + r0, r1 - r0);
    return 0;
}

/* ---------------------------------------------------------------- the thread pool */
/* The job's output rows are cut into chunks that the caller and the workers it woke take in turn (an atomic
 * counter), so a worker the OS has not scheduled yet costs nothing: the caller takes its chunks and waits only for
 * chunks already taken. A worker joins a job under the mutex only while that job is still running (`pool_busy`
 * and its generation), and the caller returns only when every chunk is done and no joined worker is left, so no
 * worker touches a job after its call returned. One job at a time; a call that finds the pool busy computes alone
 * on its own thread. After fork the workers do not exist in the child: the pool is rebuilt there on first use. */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_go = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static int pool_workers, pool_busy, pool_active, pool_failed, pool_wanted;
static pid_t pool_pid;
static unsigned long pool_gen;
static const job_t *pool_job;
static Py_ssize_t pool_chunks, pool_chunk_rows;
static Py_ssize_t pool_next, pool_finished; /* atomics */
static unsigned long worker_seen[MAX_THREADS];

/* Take and compute chunks until none is left; returns -1 if one failed (allocation). */
static int take_chunks(const job_t *j, Py_ssize_t chunks, Py_ssize_t rows) {
    int rc = 0;
    for (;;) {
        Py_ssize_t c = __atomic_fetch_add(&pool_next, 1, __ATOMIC_RELAXED);
        if (c >= chunks) return rc;
        Py_ssize_t r0 = c * rows, r1 = r0 + rows < j->out ? r0 + rows : j->out;
        if (run_chunk(j, r0, r1)) rc = -1;
        __atomic_fetch_add(&pool_finished, 1, __ATOMIC_RELEASE);
    }
}

/* A decode step calls products back to back with a little Python between them; a worker that went to sleep on the
 * condition variable takes tens of microseconds to be woken and scheduled, longer than a small product lasts, so the
 * caller would compute it alone. A worker therefore watches for the next job for up to SPIN_NS before it sleeps. */
#define SPIN_NS 200000L

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Called with pool_mu held; returns with it held, after a new job's generation was published or the spin ended. */
static void spin_for_job(unsigned long seen) {
    if (__atomic_load_n(&pool_gen, __ATOMIC_RELAXED) != seen) return;
    pthread_mutex_unlock(&pool_mu);
    const long until = now_ns() + SPIN_NS;
    for (int i = 0; __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE) == seen; i++) {
        cpu_relax();
        if ((i & 63) == 63 && now_ns() > until) break;
    }
    pthread_mutex_lock(&pool_mu);
}

/* The caller, its own chunks done, watches for the workers' last chunks and their leaving for up to SPIN_NS before it
 * sleeps on pool_done: a worker's wake-up signal to a sleeping caller costs a system call and a reschedule, tens of
 * microseconds on a virtual machine, as long as a small product. Read without the lock; the caller then checks the
 * same condition under it. */
static void wait_for_workers(Py_ssize_t chunks) {
    const long until = now_ns() + SPIN_NS;
    for (int i = 0; __atomic_load_n(&pool_finished, __ATOMIC_ACQUIRE) < chunks ||
                    __atomic_load_n(&pool_active, __ATOMIC_ACQUIRE) != 0;
         i++) {
        cpu_relax();
        if ((i & 63) == 63 && now_ns() > until) return;
    }
}

static void *worker_main(void *arg) {
    const int k = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    unsigned long seen = worker_seen[k];
    for (;;) {
        spin_for_job(seen);
        while (pool_gen == seen) pthread_cond_wait(&pool_go, &pool_mu);
        seen = pool_gen;
        if (!pool_busy || k >= pool_wanted) continue; /* that job is over, or wants fewer threads */
        const job_t *j = pool_job;
        const Py_ssize_t chunks = pool_chunks, rows = pool_chunk_rows;
        __atomic_add_fetch(&pool_active, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&pool_mu);
        int rc = take_chunks(j, chunks, rows);
        pthread_mutex_lock(&pool_mu);
        if (rc) pool_failed = 1;
        if (__atomic_sub_fetch(&pool_active, 1, __ATOMIC_RELEASE) == 0) pthread_cond_signal(&pool_done);
    }
    return NULL;
}

/* Called with the GIL held (so never concurrently with itself). */
static void pool_after_fork_check(void) {
    pid_t pid = getpid();
    if (pool_pid != pid) {
        pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
        pthread_cond_t c = PTHREAD_COND_INITIALIZER;
        pool_mu = m;
        pool_go = c;
        pool_done = c;
        pool_workers = pool_busy = pool_active = pool_failed = pool_wanted = 0;
        pool_pid = pid;
    }
}

static int run_job_rows(const job_t *j, int threads);

static inline int int_kind(int kind) { return kind == K_Q8 || kind == K_Q4 || kind == K_MXFP4; }

/* The job (and its up job, which shares x): x quantized to int16 once for the integer kinds of one-row AVX2 or AVX-512
 * products (see quantize_x16; q4's corrections xc for AVX2 only), then its rows on up to `threads` threads. */
static int run_job(job_t *j, int threads) {
#if HAVE_X86_KERNELS
    job_t *const js[2] = {j, j->up};
    const int any_int = int_kind(j->kind) || (j->up && int_kind(j->up->kind));
    const int any_q4 = j->simd != SIMD_AVX512 && (j->kind == K_Q4 || (j->up && j->up->kind == K_Q4));
    if (j->simd && j->m == 1 && any_int) {
        const Py_ssize_t nb = j->in / QBLOCK;
        int16_t *xq = (int16_t *)malloc((size_t)j->in * sizeof(int16_t));
        float *xs = (float *)malloc((size_t)nb * sizeof(float));
        int32_t *xc = any_q4 ? (int32_t *)calloc((size_t)nb * 4, sizeof(int32_t)) : NULL;
        if (!xq || !xs || (any_q4 && !xc)) {
            free(xq);
            free(xs);
            free(xc);
            return -1;
        }
        if (quantize_x16(j->x, j->in, xq, xs) == 0) {
            if (xc)
                for (Py_ssize_t b = 0; b < nb; b++) {
                    int32_t sum = 0; /* at most 32 * 32767 */
                    for (int i = 0; i < QBLOCK; i++) sum += xq[b * QBLOCK + i];
                    xc[4 * b] = 8 * sum;
                }
            for (int k = 0; k < 2; k++)
                if (js[k] && int_kind(js[k]->kind)) {
                    js[k]->xq = xq;
                    js[k]->xs = xs;
                    js[k]->xc = js[k]->kind == K_Q4 ? xc : NULL;
                }
        }
        int rc = run_job_rows(j, threads);
        for (int k = 0; k < 2; k++)
            if (js[k]) {
                js[k]->xq = NULL;
                js[k]->xs = NULL;
                js[k]->xc = NULL;
            }
        free(xq);
        free(xs);
        free(xc);
        return rc;
    }
#endif
    return run_job_rows(j, threads);
}

static int run_job_rows(const job_t *j, int threads) {
    if (threads > 1 && j->out >= 2 * MIN_CHUNK_ROWS) {
        pthread_mutex_lock(&pool_mu);
        if (pool_busy) {
            pthread_mutex_unlock(&pool_mu);
            return run_chunk(j, 0, j->out);
        }
        while (pool_workers < threads - 1) {
            pthread_t t;
            pthread_attr_t attr;
            sigset_t all, old;
            worker_seen[pool_workers] = pool_gen;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            sigfillset(&all);
            pthread_sigmask(SIG_SETMASK, &all, &old);
            int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)pool_workers);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            pthread_attr_destroy(&attr);
            if (rc) break;
            pool_workers++;
        }
        if (pool_workers == 0) {
            pthread_mutex_unlock(&pool_mu);
            return run_chunk(j, 0, j->out);
        }
        /* about 4 chunks a thread, at least MIN_CHUNK_ROWS rows each, a multiple of 4: run_rows takes rows four at a
         * time and the rest one by one, with a kernel that sums in another order, so only the product's last
         * out % 4 rows are left over, whatever the number of threads (a row's bits do not depend on it) */
        Py_ssize_t rows = (j->out + 4 * threads - 1) / (4 * threads);
        if (rows < MIN_CHUNK_ROWS) rows = MIN_CHUNK_ROWS;
        rows = (rows + 3) / 4 * 4;
        const Py_ssize_t chunks = (j->out + rows - 1) / rows;
        pool_busy = 1;
        pool_job = j;
        pool_chunks = chunks;
        pool_chunk_rows = rows;
        pool_wanted = threads - 1;
        pool_failed = 0;
        __atomic_store_n(&pool_next, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&pool_finished, 0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&pool_gen, 1, __ATOMIC_RELEASE); /* read without the lock by spinning workers */
        pthread_cond_broadcast(&pool_go);
        pthread_mutex_unlock(&pool_mu);

        int rc = take_chunks(j, chunks, rows);

        wait_for_workers(chunks);
        pthread_mutex_lock(&pool_mu);
        while (pool_active || __atomic_load_n(&pool_finished, __ATOMIC_ACQUIRE) < chunks)
            pthread_cond_wait(&pool_done, &pool_mu);
        if (pool_failed) rc = -1;
        pool_busy = 0;
        pthread_mutex_unlock(&pool_mu);
        return rc;
    }
    return run_chunk(j, 0, j->out);
}

/* ---------------------------------------------------------------- non-finite encodings */
/* A stored weight must be finite: f32/f16/bf16 with the exponent field all ones (inf, NaN), float8_e4m3fn 0x7F/0xFF
 * (its NaNs; it has no inf). `pack` scans every weight byte once per load, so the scan is cheap: 8 bytes at a time
 * (SWAR: per element, (v & M) + lowest bit of M reaches the sign bit exactly when v & M == M, and never carries into
 * the next element; AVX2 does 32 bytes at a time), OR-ed over a chunk without a branch; the exact element is looked
 * for only in a chunk with a hit. About 10 GB/s on one core: under a quarter of the time of a BLAKE3 hash. */
#define SCAN_CHUNK 4096 /* bytes */

typedef struct {
    uint64_t mask, low, sign;
    int width;
} scan_t;

static const scan_t SCANS[K_COUNT] = {
    [K_F32] = {0x7F8000007F800000ull, 0x0080000000800000ull, 0x8000000080000000ull, 4},
    [K_F16] = {0x7C007C007C007C00ull, 0x0400040004000400ull, 0x8000800080008000ull, 2},
    [K_BF16] = {0x7F807F807F807F80ull, 0x0080008000800080ull, 0x8000800080008000ull, 2},
    [K_FP8] = {0x7F7F7F7F7F7F7F7Full, 0x0101010101010101ull, 0x8080808080808080ull, 1},
};

static int nonfinite_at(int kind, const uint8_t *p, Py_ssize_t i) {
    switch (kind) {
    case K_F32: {
        uint32_t v;
        memcpy(&v, p + 4 * i, 4);
        return (v & 0x7F800000u) == 0x7F800000u;
    }
    case K_F16:
    case K_BF16: {
        uint16_t v, m = kind == K_F16 ? 0x7C00 : 0x7F80;
        memcpy(&v, p + 2 * i, 2);
        return (v & m) == m;
    }
    default: return (p[i] & 0x7F) == 0x7F;
    }
}

#if HAVE_X86_KERNELS
/* The same test on 32 bytes at a time (four 64-bit lanes), `len` a multiple of 64: nonzero if a hit. */
TARGET_AVX2 static int chunk_hit_avx2(const uint8_t *p, Py_ssize_t len, const scan_t *sc) {
    const __m256i mask = _mm256_set1_epi64x((long long)sc->mask), low = _mm256_set1_epi64x((long long)sc->low);
    const __m256i sign = _mm256_set1_epi64x((long long)sc->sign);
    __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
    for (Py_ssize_t i = 0; i < len; i += 64) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(p + i));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(p + i + 32));
        h0 = _mm256_or_si256(h0, _mm256_add_epi64(_mm256_and_si256(a, mask), low));
        h1 = _mm256_or_si256(h1, _mm256_add_epi64(_mm256_and_si256(b, mask), low));
    }
    const __m256i h = _mm256_and_si256(_mm256_or_si256(h0, h1), sign);
    return !_mm256_testz_si256(h, h);
}
#endif

/* The index of the first non-finite element of `n` elements of `kind` (f32, f16, bf16, fp8) at `p`, or -1. */
static Py_ssize_t find_nonfinite(int kind, const uint8_t *p, Py_ssize_t n, int avx2) {
    const scan_t sc = SCANS[kind];
    const Py_ssize_t bytes = n * sc.width;
    Py_ssize_t c0 = 0;
    (void)avx2;
    for (; c0 < bytes; c0 += SCAN_CHUNK) {
        const Py_ssize_t c1 = c0 + SCAN_CHUNK < bytes ? c0 + SCAN_CHUNK : bytes;
        uint64_t hit = 0;
        Py_ssize_t i = c0;
#if HAVE_X86_KERNELS
        if (avx2) {
            const Py_ssize_t len = (c1 - c0) & ~(Py_ssize_t)63;
            hit = (uint64_t)chunk_hit_avx2(p + c0, len, &sc);
            i += len;
        }
#endif
        for (; i + 8 <= c1; i += 8) {
            uint64_t v;
            memcpy(&v, p + i, 8);
            hit |= ((v & sc.mask) + sc.low) & sc.sign;
        }
        for (; i < c1; i += sc.width) hit |= (uint64_t)nonfinite_at(kind, p, i / sc.width);
        if (hit) break;
    }
    for (Py_ssize_t i = c0 / sc.width; i < n; i++)
        if (nonfinite_at(kind, p, i)) return i;
    return -1;
}

/* ---------------------------------------------------------------- argument checking */

static int get_buffer(PyObject *obj, Py_buffer *view, const char *name, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous%s buffer", name, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* The buffer's element format is exactly `want` (one struct character, native or little-endian standard size),
 * its itemsize `itemsize`, and its length `count` items. */
static int check_buffer(const Py_buffer *v, const char *name, char want, Py_ssize_t itemsize, Py_ssize_t count) {
    const char *f = v->format ? v->format : "B";
    if (f[0] == '@' || f[0] == '=' || (f[0] == '<' && PY_LITTLE_ENDIAN)) f++;
    if (f[0] != want || f[1] != '\0' || v->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected format '%c' of %zd bytes, got '%s' of %zd bytes", name, want,
                     itemsize, v->format ? v->format : "B", v->itemsize);
        return -1;
    }
    if (count < 0 || v->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items, got %zd bytes", name, count, v->len);
        return -1;
    }
    /* a typed load from an address that is not a multiple of its size is undefined behaviour in C (a view into a
     * safetensors file may start at any byte): the caller copies such an array once instead */
    if ((uintptr_t)v->buf % (uintptr_t)itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: address not aligned to its %zd-byte items", name, itemsize);
        return -1;
    }
    return 0;
}

/* An int argument as a Py_ssize_t: TypeError if not an int, ValueError beyond +-PY_SSIZE_T_MAX/2 (every caller's
 * range is far smaller and checked after), never OverflowError. */
static int get_int(PyObject *o, const char *name, Py_ssize_t *v) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.80s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long r = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (r == -1 && PyErr_Occurred()) return -1;
    const long long lim = (long long)(PY_SSIZE_T_MAX / 2);
    if (overflow || r > lim || r < -lim) {
        PyErr_Format(PyExc_ValueError, "%s=%R out of range", name, o);
        return -1;
    }
    *v = (Py_ssize_t)r;
    return 0;
}

static int kind_of(const char *s) {
    for (int k = 0; k < K_COUNT; k++)
        if (strcmp(s, KIND_NAMES[k]) == 0) return k;
    return -1;
}

static int cpu_simd = SIMD_PLAIN; /* the best the CPU has, unless use_simd chose less */

/* One weight's stored buffers, opened and checked against its kind and shape (see _packed.Packed). */
typedef struct {
    int kind;
    Py_ssize_t out, in, b0, b1;
    Py_buffer wv, sv;
    int have_w, have_s;
} weight_t;

static void weight_release(weight_t *w) {
    if (w->have_w) PyBuffer_Release(&w->wv);
    if (w->have_s) PyBuffer_Release(&w->sv);
    w->have_w = w->have_s = 0;
}

/* Opens data and scale of a weight [out, in] stored as `kind_s` (bf16 data as a uint16 view, fp8 as uint8; scale
 * None for f32/f16/bf16): every format, item count and alignment checked before any read. -1 with an exception set
 * (and nothing left open) otherwise. */
static int weight_open(weight_t *w, const char *kind_s, PyObject *wo, PyObject *so, Py_ssize_t out, Py_ssize_t in,
                       Py_ssize_t b0, Py_ssize_t b1) {
    memset(w, 0, sizeof(*w));
    const int kind = kind_of(kind_s);
    if (kind < 0) {
        PyErr_Format(PyExc_ValueError, "unknown weight kind '%.20s'", kind_s);
        return -1;
    }
    const Py_ssize_t cap = (Py_ssize_t)1 << 31;
    if (out < 1 || in < 1 || out > cap || in > cap) {
        PyErr_Format(PyExc_ValueError, "weight shape out=%zd in=%zd out of range", out, in);
        return -1;
    }
    if ((kind == K_Q8 || kind == K_Q4 || kind == K_MXFP4) && in % QBLOCK) {
        PyErr_Format(PyExc_ValueError, "%s: in_=%zd is not a multiple of %d", kind_s, in, QBLOCK);
        return -1;
    }
    if (kind == K_FP8 && (b0 < 1 || b1 < 1 || b0 > cap || b1 > cap)) {
        PyErr_Format(PyExc_ValueError, "fp8: block (%zd, %zd) out of range", b0, b1);
        return -1;
    }
    const Py_ssize_t wn = out * in; /* both <= 2^31: no overflow in a 64-bit Py_ssize_t */
    if (wn > PY_SSIZE_T_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "weight shape out=%zd in=%zd too large", out, in);
        return -1;
    }
    /* data and scale: format, itemsize and item counts per kind */
    char wf = 'f', sf = 0;
    Py_ssize_t wsize = 4, ssize = 0, wcount = wn, scount = 0;
    switch (kind) {
    case K_F32: break;
    case K_F16: wf = 'e'; wsize = 2; break;
    case K_BF16: wf = 'H'; wsize = 2; break;
    case K_FP8:
        wf = 'B'; wsize = 1; sf = 'f'; ssize = 4;
        scount = ((out + b0 - 1) / b0) * ((in + b1 - 1) / b1);
        break;
    case K_Q8: wf = 'b'; wsize = 1; sf = 'e'; ssize = 2; scount = out * (in / QBLOCK); break;
    case K_Q4: wf = 'B'; wsize = 1; wcount = wn / 2; sf = 'e'; ssize = 2; scount = out * (in / QBLOCK); break;
    case K_MXFP4: wf = 'B'; wsize = 1; wcount = wn / 2; sf = 'B'; ssize = 1; scount = out * (in / QBLOCK); break;
    }
    w->kind = kind;
    w->out = out;
    w->in = in;
    w->b0 = b0;
    w->b1 = b1;
    if (get_buffer(wo, &w->wv, "data", 0) < 0) return -1;
    w->have_w = 1;
    if (check_buffer(&w->wv, "data", wf, wsize, wcount) < 0) goto fail;
    if (sf) {
        if (so == Py_None) {
            PyErr_Format(PyExc_ValueError, "%s: a scale is required", kind_s);
            goto fail;
        }
        if (get_buffer(so, &w->sv, "scale", 0) < 0) goto fail;
        w->have_s = 1;
        if (check_buffer(&w->sv, "scale", sf, ssize, scount) < 0) goto fail;
    } else if (so != Py_None) {
        PyErr_Format(PyExc_ValueError, "%s: no scale expected", kind_s);
        goto fail;
    }
    return 0;
fail:
    weight_release(w);
    return -1;
}

/* A weight given as the tuple _packed.Packed.native: (kind, data, scale, out, in_, b0, b1). */
static int weight_open_tuple(weight_t *w, PyObject *t, const char *name) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 7 || !PyUnicode_Check(PyTuple_GET_ITEM(t, 0))) {
        PyErr_Format(PyExc_TypeError, "%s: expected a (kind, data, scale, out, in_, b0, b1) tuple", name);
        return -1;
    }
    static const char *const int_names[4] = {"out", "in_", "b0", "b1"};
    Py_ssize_t iv[4];
    for (int k = 0; k < 4; k++)
        if (get_int(PyTuple_GET_ITEM(t, 3 + k), int_names[k], &iv[k]) < 0) return -1;
    const char *kind_s = PyUnicode_AsUTF8(PyTuple_GET_ITEM(t, 0));
    if (!kind_s) return -1;
    return weight_open(w, kind_s, PyTuple_GET_ITEM(t, 1), PyTuple_GET_ITEM(t, 2), iv[0], iv[1], iv[2], iv[3]);
}

static int overlaps(const Py_buffer *a, const void *b0, Py_ssize_t blen) {
    const char *a0 = (const char *)a->buf, *a1 = a0 + a->len, *c0 = (const char *)b0, *c1 = c0 + blen;
    return a0 < c1 && c0 < a1;
}

/* The output buffer y must not overlap any input (it is written while they are read). */
static int check_disjoint(const Py_buffer *y, const Py_buffer *const *ins, int n) {
    for (int k = 0; k < n; k++)
        if (ins[k] && overlaps(ins[k], y->buf, y->len)) {
            PyErr_SetString(PyExc_ValueError, "y overlaps an input");
            return -1;
        }
    return 0;
}

static int get_threads(PyObject *o, int *threads) {
    Py_ssize_t t;
    if (get_int(o, "threads", &t) < 0) return -1;
    if (t < 1 || t > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads=%zd: expected 1..%d", t, MAX_THREADS);
        return -1;
    }
    *threads = (int)t;
    return 0;
}

static job_t job_of(const weight_t *w, Py_ssize_t m, const float *x, float *y) {
    job_t j = {w->kind, m, w->out, w->in, w->b0, w->b1, x, w->wv.buf, w->have_s ? w->sv.buf : NULL, y, cpu_simd,
               NULL, NULL, NULL, NULL};
    return j;
}

PyDoc_STRVAR(matmul_doc,
             "matmul(kind, x, data, scale, y, m, out, in_, b0, b1, threads) -> None\n\n"
             "y[m, out] = x[m, in_] @ W.T for W [out, in_] stored as `kind` (data, scale: see _packed.Packed; bf16 "
             "data as uint16 and fp8 data as uint8 views; scale None for f32/f16/bf16), float32 x and y, on up to "
             "`threads` threads with the GIL released. b0, b1: fp8's block (ignored otherwise). Every buffer must "
             "be C-contiguous with the exact format and length: ValueError otherwise.");

/* y[m, out] = x[m, in] @ W.T for the opened weight `w` (released here, as are x and y); m < 0: as many rows as x
 * holds (it must hold a whole number). */
static PyObject *product_into(weight_t *w, PyObject *xo, PyObject *yo, Py_ssize_t m, int threads) {
    PyObject *result = NULL;
    Py_buffer xv, yv;
    int have_x = 0, have_y = 0;
    if (get_buffer(xo, &xv, "x", 0) < 0) goto done;
    have_x = 1;
    if (m < 0) m = xv.len / 4 / w->in;
    if (m < 1 || m > ((Py_ssize_t)1 << 31)) {
        PyErr_Format(PyExc_ValueError, "shape m=%zd out=%zd in=%zd out of range", m, w->out, w->in);
        goto done;
    }
    const Py_ssize_t xn = m * w->in, yn = m * w->out;
    if (xn > PY_SSIZE_T_MAX / 8 || yn > PY_SSIZE_T_MAX / 8) {
        PyErr_Format(PyExc_ValueError, "shape m=%zd out=%zd in=%zd too large", m, w->out, w->in);
        goto done;
    }
    if (check_buffer(&xv, "x", 'f', 4, xn) < 0) goto done;
    if (get_buffer(yo, &yv, "y", 1) < 0) goto done;
    have_y = 1;
    if (check_buffer(&yv, "y", 'f', 4, yn) < 0) goto done;
    {
        const Py_buffer *ins[3] = {&xv, &w->wv, w->have_s ? &w->sv : NULL};
        if (check_disjoint(&yv, ins, 3) < 0) goto done;
    }
    job_t j = job_of(w, m, (const float *)xv.buf, (float *)yv.buf);
    int rc;
    pool_after_fork_check();
    if (xn + w->out * w->in < GIL_WORK) {
        /* too small to be worth giving the GIL away (taking it back can wait for another thread's switch) */
        rc = run_job(&j, 1);
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = run_job(&j, threads);
        Py_END_ALLOW_THREADS
    }
    if (rc) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    if (have_x) PyBuffer_Release(&xv);
    if (have_y) PyBuffer_Release(&yv);
    weight_release(w);
    return result;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    (void)self;
    const char *kind_s;
    PyObject *xo, *wo, *so, *yo, *io[6];
    if (!PyArg_ParseTuple(args, "sOOOOOOOOOO:matmul", &kind_s, &xo, &wo, &so, &yo, &io[0], &io[1], &io[2], &io[3],
                          &io[4], &io[5]))
        return NULL;
    static const char *const int_names[5] = {"m", "out", "in_", "b0", "b1"};
    Py_ssize_t iv[5];
    for (int k = 0; k < 5; k++)
        if (get_int(io[k], int_names[k], &iv[k]) < 0) return NULL;
    int threads;
    if (get_threads(io[5], &threads) < 0) return NULL;
    if (iv[0] < 1 || iv[0] > ((Py_ssize_t)1 << 31))
        return PyErr_Format(PyExc_ValueError, "shape m=%zd out=%zd in=%zd out of range", iv[0], iv[1], iv[2]);
    weight_t w;
    if (weight_open(&w, kind_s, wo, so, iv[1], iv[2], iv[3], iv[4]) < 0) return NULL;
    return product_into(&w, xo, yo, iv[0], threads);
}

PyDoc_STRVAR(product_doc,
             "product(w, x, y, threads) -> None\n\n"
             "matmul with the weight given as its Packed.native tuple (kind, data, scale, out, in_, b0, b1): "
             "y[m, out] = x[m, in_] @ W.T, m = len(x) / in_ (x must hold a whole number of rows).");

static PyObject *py_product(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "product expects 4 arguments, got %zd", nargs);
    int threads;
    if (get_threads(args[3], &threads) < 0) return NULL;
    weight_t w;
    if (weight_open_tuple(&w, args[0], "w") < 0) return NULL;
    return product_into(&w, args[1], args[2], -1, threads);
}

/* ---------------------------------------------------------------- fused steps of a layer */

/* h[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u, in place in g (float32 throughout, as the numpy path) */
static void silu_mul(float *g, const float *u, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float v = g[i];
        g[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

/* y[m, H] = down(silu(gate x) * up x) for opened weights w[3] that chain, the [m, I] intermediates its own;
 * -1 when out of memory. Needs no GIL. */
static int swiglu_rows(const weight_t *w, const float *x, float *y, Py_ssize_t m, int threads) {
    const Py_ssize_t hid = w[0].in, inter = w[0].out;
    float *g = (float *)malloc((size_t)(m * inter) * sizeof(float));
    float *u = (float *)malloc((size_t)(m * inter) * sizeof(float));
    int rc = -1;
    if (g && u) {
        job_t jg = job_of(&w[0], m, x, g), ju = job_of(&w[1], m, x, u), jd = job_of(&w[2], m, g, y);
        jg.up = &ju; /* one pool job: gate and up rows, then silu(gate) * up, chunk by chunk */
        const int t = m * hid + 3 * inter * hid < GIL_WORK ? 1 : threads;
        rc = run_job(&jg, t);
        if (!rc) rc = run_job(&jd, t);
    }
    free(g);
    free(u);
    return rc;
}

PyDoc_STRVAR(swiglu_doc,
             "swiglu(gate, up, down, x, y, threads) -> None\n\n"
             "The SwiGLU expert in one call: y[m, H] = down(silu(gate x) * up x) for x [m, H], gate and up [I, H], "
             "down [H, I], each a Packed.native tuple (kind, data, scale, out, in_, b0, b1); the [m, I] "
             "intermediates are the call's own. Shapes must chain: ValueError otherwise.");

static PyObject *py_swiglu(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) return PyErr_Format(PyExc_TypeError, "swiglu expects 6 arguments, got %zd", nargs);
    int threads;
    if (get_threads(args[5], &threads) < 0) return NULL;
    weight_t w[3];
    int opened = 0;
    PyObject *result = NULL;
    Py_buffer xv, yv;
    int have_x = 0, have_y = 0;
    static const char *const names[3] = {"gate", "up", "down"};
    for (; opened < 3; opened++)
        if (weight_open_tuple(&w[opened], args[opened], names[opened]) < 0) goto done;
    const Py_ssize_t hid = w[0].in, inter = w[0].out;
    if (w[1].in != hid || w[1].out != inter || w[2].in != inter || w[2].out != hid) {
        PyErr_Format(PyExc_ValueError, "swiglu: gate [%zd, %zd], up [%zd, %zd], down [%zd, %zd] do not chain",
                     w[0].out, w[0].in, w[1].out, w[1].in, w[2].out, w[2].in);
        goto done;
    }
    if (get_buffer(args[3], &xv, "x", 0) < 0) goto done;
    have_x = 1;
    const Py_ssize_t m = xv.len / 4 / hid;
    if (m < 1 || m > ((Py_ssize_t)1 << 20) || check_buffer(&xv, "x", 'f', 4, m * hid) < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "x: expected 1 to 2^20 rows of %zd floats", hid);
        goto done;
    }
    if (get_buffer(args[4], &yv, "y", 1) < 0) goto done;
    have_y = 1;
    if (check_buffer(&yv, "y", 'f', 4, m * hid) < 0) goto done;
    {
        const Py_buffer *ins[7] = {&xv, &w[0].wv, w[0].have_s ? &w[0].sv : NULL, &w[1].wv,
                                   w[1].have_s ? &w[1].sv : NULL, &w[2].wv, w[2].have_s ? &w[2].sv : NULL};
        if (check_disjoint(&yv, ins, 7) < 0) goto done;
    }
    {
        int rc;
        pool_after_fork_check();
        Py_BEGIN_ALLOW_THREADS
        rc = swiglu_rows(w, (const float *)xv.buf, (float *)yv.buf, m, threads);
        Py_END_ALLOW_THREADS
        if (rc) {
            PyErr_NoMemory();
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    if (have_x) PyBuffer_Release(&xv);
    if (have_y) PyBuffer_Release(&yv);
    for (int k = 0; k < opened; k++) weight_release(&w[k]);
    return result;
}

/* y[m, d] = w * x * rsqrt(mean(x^2) + eps) per row (the sum of squares in double) */
static void rms_norm_rows(const float *x, const float *w, float eps, float *y, Py_ssize_t m, Py_ssize_t d) {
    for (Py_ssize_t r = 0; r < m; r++, x += d, y += d) {
        double ss = 0;
        for (Py_ssize_t i = 0; i < d; i++) ss += (double)x[i] * x[i];
        const float inv = 1.0f / sqrtf((float)(ss / d) + eps);
        for (Py_ssize_t i = 0; i < d; i++) y[i] = x[i] * inv * w[i];
    }
}

PyDoc_STRVAR(rms_norm_doc,
             "rms_norm(x, w, eps, y) -> None\n\n"
             "y[m, d] = w * x * rsqrt(mean(x^2) + eps) per row, float32 (the sum of squares in double).");

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "rms_norm expects 4 arguments, got %zd", nargs);
    const double eps = PyFloat_AsDouble(args[2]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    Py_buffer xv, wv, yv;
    if (get_buffer(args[1], &wv, "w", 0) < 0) return NULL;
    PyObject *result = NULL;
    int have_x = 0, have_y = 0;
    const Py_ssize_t d = wv.len / 4;
    if (d < 1 || check_buffer(&wv, "w", 'f', 4, d) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "w: expected a non-empty float32 vector");
        goto done;
    }
    if (get_buffer(args[0], &xv, "x", 0) < 0) goto done;
    have_x = 1;
    const Py_ssize_t m = xv.len / 4 / d;
    if (m < 1 || check_buffer(&xv, "x", 'f', 4, m * d) < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "x: expected rows of %zd floats", d);
        goto done;
    }
    if (get_buffer(args[3], &yv, "y", 1) < 0) goto done;
    have_y = 1;
    if (check_buffer(&yv, "y", 'f', 4, m * d) < 0) goto done;
    {
        const Py_buffer *ins[2] = {&xv, &wv};
        if (check_disjoint(&yv, ins, 2) < 0) goto done;
    }
    rms_norm_rows((const float *)xv.buf, (const float *)wv.buf, (float)eps, (float *)yv.buf, m, d);
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&wv);
    if (have_x) PyBuffer_Release(&xv);
    if (have_y) PyBuffer_Release(&yv);
    return result;
}

/* x[r, d] = x * cos + rotate_half(x) * sin in place, rotate_half pairing channel i with i + d/2 */
static void rope_rows(float *x, const float *c, const float *sn, Py_ssize_t rows, Py_ssize_t d) {
    const Py_ssize_t half = d / 2;
    for (Py_ssize_t r = 0; r < rows; r++, x += d)
        for (Py_ssize_t i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * c[i] + -b * sn[i];
            x[i + half] = b * c[i + half] + a * sn[i + half];
        }
}

PyDoc_STRVAR(rope_doc,
             "rope(x, cos, sin) -> None\n\n"
             "Rotary position embedding in place on the rows of x [r, d] (every head of one position): "
             "x = x * cos + rotate_half(x) * sin with cos, sin [d] and rotate_half pairing channel i with i + d/2.");

static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "rope expects 3 arguments, got %zd", nargs);
    Py_buffer xv, cv, sv;
    if (get_buffer(args[1], &cv, "cos", 0) < 0) return NULL;
    PyObject *result = NULL;
    int have_s = 0, have_x = 0;
    const Py_ssize_t d = cv.len / 4;
    if (d < 2 || d % 2 || check_buffer(&cv, "cos", 'f', 4, d) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "cos: expected an even, non-empty float32 vector");
        goto done;
    }
    if (get_buffer(args[2], &sv, "sin", 0) < 0) goto done;
    have_s = 1;
    if (check_buffer(&sv, "sin", 'f', 4, d) < 0) goto done;
    if (get_buffer(args[0], &xv, "x", 1) < 0) goto done;
    have_x = 1;
    const Py_ssize_t rows = xv.len / 4 / d;
    if (rows < 1 || check_buffer(&xv, "x", 'f', 4, rows * d) < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "x: expected rows of %zd floats", d);
        goto done;
    }
    if (overlaps(&xv, cv.buf, cv.len) || overlaps(&xv, sv.buf, sv.len)) {
        PyErr_SetString(PyExc_ValueError, "x overlaps cos or sin");
        goto done;
    }
    rope_rows((float *)xv.buf, (const float *)cv.buf, (const float *)sv.buf, rows, d);
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&cv);
    if (have_s) PyBuffer_Release(&sv);
    if (have_x) PyBuffer_Release(&xv);
    return result;
}

/* A [heads, S, d] float32 array whose rows are contiguous and heads evenly strided (a KV cache's view), its buffer
 * opened once: `heads` and `*d` of 0 take the array's own (at least 1). Returns -1 with a ValueError, nothing held,
 * otherwise. */
static int get_heads(PyObject *o, Py_buffer *v, const char *name, Py_ssize_t heads, Py_ssize_t *s, Py_ssize_t *d,
                     int writable) {
    if (PyObject_GetBuffer(o, v, PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected a strided%s buffer", name, writable ? " writable" : "");
        return -1;
    }
    if (v->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "%s: expected 3 dimensions [heads, S, d]", name);
        PyBuffer_Release(v);
        return -1;
    }
    if (heads == 0) heads = v->shape[0];
    if (*d == 0) *d = v->shape[2];
    const char *f = v->format ? v->format : "B";
    if (f[0] == '@' || f[0] == '=' || (f[0] == '<' && PY_LITTLE_ENDIAN)) f++;
    if (heads < 1 || *d < 1 || f[0] != 'f' || f[1] != '\0' || v->itemsize != 4 || v->shape[0] != heads ||
        v->shape[2] != *d || v->shape[1] < 1 || v->strides[2] != 4 || v->strides[1] != 4 * *d ||
        v->strides[0] < 4 * *d * v->shape[1] || v->strides[0] % 4 || (uintptr_t)v->buf % 4) {
        PyErr_Format(PyExc_ValueError, "%s: expected float32 [%zd, S, %zd] with contiguous rows", name, heads, *d);
        PyBuffer_Release(v);
        return -1;
    }
    *s = v->shape[1];
    return 0;
}

/* The plain C path of attend_group: query head by query head, positions in order. */
static void attend_group_plain(const float *q, const float *k, const float *v, Py_ssize_t g, Py_ssize_t s,
                               Py_ssize_t d, Py_ssize_t dv, float sc, float *p, float *out) {
    for (Py_ssize_t h = 0; h < g; h++) {
        float mx = -INFINITY;
        for (Py_ssize_t t = 0; t < s; t++) {
            p[t] = dot_plain(q + h * d, k + t * d, d) * sc;
            if (p[t] > mx) mx = p[t];
        }
        float sum = 0;
        for (Py_ssize_t t = 0; t < s; t++) {
            p[t] = expf(p[t] - mx);
            sum += p[t];
        }
        const float inv = 1.0f / sum;
        float *o = out + h * dv;
        memset(o, 0, (size_t)dv * sizeof(float));
        for (Py_ssize_t t = 0; t < s; t++) {
            const float pt = p[t] * inv, *vt = v + t * dv;
            for (Py_ssize_t i = 0; i < dv; i++) o[i] += pt * vt[i];
        }
    }
}

#if HAVE_X86_KERNELS
/* exp(x) for 8 floats: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, ln2 in two parts; a degree-5 polynomial for
 * (e^r - 1 - r) / r^2; 2^n built in the exponent field): within 1.01 ulp of the exact value for every float x in
 * [-87.3, 88] (checked exhaustively against double exp when written). x clamped
 * to +-88.376: exp(-inf) and any result below 2^-126.5 (x below -87.68) are 0 where expf gives a subnormal,
 * exp(+inf) is inf, NaN stays NaN (the clamps take x as the operand returned for NaN). */
TARGET_AVX2 static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Scores p[r * s + t] = (q_r . k_t) * sc of R query heads q [R, d] (R a constant: 4, 2 or 1), each key row loaded
 * once for the R products. The unroll pragmas keep the R accumulators in registers (without them -O2 leaves these
 * arrays on the stack, about 3x slower). */
TARGET_AVX2 static inline __attribute__((always_inline)) void scores_avx2(const float *q, const float *k, Py_ssize_t s,
                                                                          Py_ssize_t d, float sc, float *p, int R) {
    for (Py_ssize_t t = 0; t < s; t++) {
        const float *kt = k + t * d;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        Py_ssize_t i = 0;
        for (; i + 8 <= d; i += 8) {
            const __m256 kv = _mm256_loadu_ps(kt + i);
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + i), kv, acc[r]);
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            float sum = hsum8(acc[r]);
            for (Py_ssize_t j = i; j < d; j++) sum += q[r * d + j] * kt[j];
            p[r * s + t] = sum * sc;
        }
    }
}

/* out [R, dv] = p [R, s] @ v [s, dv] for R (4, 2 or 1) probability rows: 16 columns at a time in registers, each
 * value row's columns loaded once for the R rows. */
TARGET_AVX2 static inline __attribute__((always_inline)) void mix_avx2(const float *p, const float *v, Py_ssize_t s,
                                                                       Py_ssize_t dv, float *out, int R) {
    Py_ssize_t c = 0;
    for (; c + 16 <= dv; c += 16) {
        __m256 a[4], b[4];
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) a[r] = b[r] = _mm256_setzero_ps();
        for (Py_ssize_t t = 0; t < s; t++) {
            const __m256 v0 = _mm256_loadu_ps(v + t * dv + c), v1 = _mm256_loadu_ps(v + t * dv + c + 8);
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                const __m256 pr = _mm256_broadcast_ss(p + r * s + t);
                a[r] = _mm256_fmadd_ps(pr, v0, a[r]);
                b[r] = _mm256_fmadd_ps(pr, v1, b[r]);
            }
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(out + r * dv + c, a[r]);
            _mm256_storeu_ps(out + r * dv + c + 8, b[r]);
        }
    }
    for (; c + 8 <= dv; c += 8) {
        __m256 a[4];
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
        for (Py_ssize_t t = 0; t < s; t++) {
            const __m256 v0 = _mm256_loadu_ps(v + t * dv + c);
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
                a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * s + t), v0, a[r]);
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * dv + c, a[r]);
    }
    for (; c < dv; c++)
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            float sum = 0;
            for (Py_ssize_t t = 0; t < s; t++) sum += p[r * s + t] * v[t * dv + c];
            out[r * dv + c] = sum;
        }
}

/* p [s] = softmax(p) in place: the largest score subtracted, exp_avx2 8 at a time (expf for the tail). */
TARGET_AVX2 static void softmax_avx2(float *p, Py_ssize_t s) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    Py_ssize_t t = 0;
    for (; t + 8 <= s; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(p + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float mx = _mm_cvtss_f32(m4);
    for (; t < s; t++)
        if (p[t] > mx) mx = p[t];
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= s; t += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + t), mxv));
        _mm256_storeu_ps(p + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum8(sum8);
    for (; t < s; t++) {
        p[t] = expf(p[t] - mx);
        sum += p[t];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (t = 0; t + 8 <= s; t += 8) _mm256_storeu_ps(p + t, _mm256_mul_ps(_mm256_loadu_ps(p + t), inv));
    for (; t < s; t++) p[t] *= 1.0f / sum;
}

#define ATTEND_ROWS(R)                                                                                             \
    do {                                                                                                           \
        scores_avx2(q + h * d, k, s, d, sc, p, R);                                                                 \
        for (int r = 0; r < R; r++) softmax_avx2(p + r * s, s);                                                    \
        mix_avx2(p, v, s, dv, out + h * dv, R);                                                                    \
        h += R;                                                                                                    \
    } while (0)

/* attend_group on AVX2: the query heads four (then two, one) at a time, each key and value row loaded once for
 * them; p holds 4 * s floats. */
TARGET_AVX2 static void attend_group_avx2(const float *q, const float *k, const float *v, Py_ssize_t g, Py_ssize_t s,
                                          Py_ssize_t d, Py_ssize_t dv, float sc, float *p, float *out) {
    Py_ssize_t h = 0;
    while (g - h >= 4) ATTEND_ROWS(4);
    if (g - h >= 2) ATTEND_ROWS(2);
    if (g - h >= 1) ATTEND_ROWS(1);
}
#undef ATTEND_ROWS
#endif

/* out [g, dv] = softmax(q k^T * sc) v for the g query heads q [g, d] that read one kv head, k [s, d] and v [s, dv];
 * p: scratch of 4 * s floats. */
static void attend_group(const float *q, const float *k, const float *v, Py_ssize_t g, Py_ssize_t s, Py_ssize_t d,
                         Py_ssize_t dv, float sc, float *p, float *out) {
#if HAVE_X86_KERNELS
    if (cpu_simd) {
        attend_group_avx2(q, k, v, g, s, d, dv, sc, p, out);
        return;
    }
#endif
    attend_group_plain(q, k, v, g, s, d, dv, sc, p, out);
}

PyDoc_STRVAR(route_softmax_doc,
             "route_softmax(logits, k, norm, probs, weights, ids) -> bool\n\n"
             "The softmax top-k router (Mixtral, Qwen, OLMoE) on T rows of E logits, float32: probs[T, E] = "
             "softmax(logits) (exp of each logit minus its row's largest, over their sum taken in double); ids[T, k] "
             "(int64) the k largest probabilities' experts, largest first, a tie to the lower id; weights[T, k] their "
             "probabilities, over their sum when `norm` (taken in float32, in ids' order). Every buffer 2-D of those "
             "shapes. False, with nothing written, when a logit is not finite (numpy's path then defines the "
             "result).");

static PyObject *py_route_softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) return PyErr_Format(PyExc_TypeError, "route_softmax expects 6 arguments, got %zd", nargs);
    Py_ssize_t k;
    if (get_int(args[1], "k", &k) < 0) return NULL;
    const int norm = PyObject_IsTrue(args[2]);
    if (norm < 0) return NULL;
    if (k < 1 || k > MAX_TOP_K)
        return PyErr_Format(PyExc_ValueError, "route_softmax: k=%zd, expected 1..%d", k, MAX_TOP_K);
    Py_buffer lv, pv, wv, iv;
    int have_l = 0, have_p = 0, have_w = 0, have_i = 0;
    PyObject *result = NULL;
    if (get_buffer(args[0], &lv, "logits", 0) < 0) goto done;
    have_l = 1;
    if (get_buffer(args[4], &wv, "weights", 1) < 0) goto done;
    have_w = 1;
    const Py_ssize_t t = wv.len / 4 / k;
    if (t < 1 || check_buffer(&wv, "weights", 'f', 4, t * k) < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "weights: expected rows of %zd floats", k);
        goto done;
    }
    const Py_ssize_t e = lv.len / 4 / t;
    if (e < k || e > (1 << 20) || check_buffer(&lv, "logits", 'f', 4, t * e) < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "logits: expected %zd rows of k=%zd to 2^20 floats", t, k);
        goto done;
    }
    if (get_buffer(args[3], &pv, "probs", 1) < 0) goto done;
    have_p = 1;
    if (check_buffer(&pv, "probs", 'f', 4, t * e) < 0) goto done;
    if (get_buffer(args[5], &iv, "ids", 1) < 0) goto done;
    have_i = 1;
    if (check_buffer(&iv, "ids", iv.format && strchr(iv.format, 'q') ? 'q' : 'l', 8, t * k) < 0) goto done; /* int64 */
    if (lv.ndim != 2 || pv.ndim != 2 || wv.ndim != 2 || iv.ndim != 2 || lv.shape[0] != t || pv.shape[0] != t ||
        wv.shape[0] != t || iv.shape[0] != t || lv.shape[1] != e || pv.shape[1] != e || wv.shape[1] != k ||
        iv.shape[1] != k) {
        PyErr_Format(PyExc_ValueError,
                     "route_softmax: expected logits and probs [%zd, %zd], weights and ids [%zd, %zd]", t, e, t, k);
        goto done;
    }
    {
        const Py_buffer *ins[1] = {&lv};
        const Py_buffer *outs[2] = {&pv, &wv};
        if (check_disjoint(&pv, ins, 1) < 0 || check_disjoint(&wv, ins, 1) < 0 || check_disjoint(&iv, ins, 1) < 0 ||
            check_disjoint(&iv, outs, 2) < 0 || check_disjoint(&wv, outs, 1) < 0)
            goto done;
    }
    const float *logits = (const float *)lv.buf;
    for (Py_ssize_t i = 0; i < t * e; i++)
        if (!isfinite(logits[i])) {
            result = Py_NewRef(Py_False);
            goto done;
        }
    for (Py_ssize_t r = 0; r < t; r++) {
        const float *l = logits + r * e;
        float *p = (float *)pv.buf + r * e, *w = (float *)wv.buf + r * k;
        int64_t *ids = (int64_t *)iv.buf + r * k;
        float top = l[0];
        for (Py_ssize_t i = 1; i < e; i++) top = l[i] > top ? l[i] : top;
        double sum = 0;
        for (Py_ssize_t i = 0; i < e; i++) {
            p[i] = expf(l[i] - top); /* <= 1, and 1 at the largest: the sum is in [1, e] */
            sum += p[i];
        }
        const float total = (float)sum;
        Py_ssize_t have = 0; /* ids[0..have) sorted: larger first, a tie to the lower id (seen first) */
        for (Py_ssize_t i = 0; i < e; i++) {
            p[i] /= total;
            if (have == k && !(p[i] > p[ids[k - 1]])) continue;
            Py_ssize_t at = have < k ? have++ : k - 1;
            while (at > 0 && p[i] > p[ids[at - 1]]) {
                ids[at] = ids[at - 1];
                at--;
            }
            ids[at] = i;
        }
        float picked = 0.0f;
        for (Py_ssize_t j = 0; j < k; j++) {
            w[j] = p[ids[j]];
            picked += w[j];
        }
        if (norm)
            for (Py_ssize_t j = 0; j < k; j++) w[j] /= picked;
    }
    result = Py_NewRef(Py_True);
done:
    if (have_l) PyBuffer_Release(&lv);
    if (have_p) PyBuffer_Release(&pv);
    if (have_w) PyBuffer_Release(&wv);
    if (have_i) PyBuffer_Release(&iv);
    return result;
}

PyDoc_STRVAR(attend_row_doc,
             "attend_row(q, k, v, scale, out) -> None\n\n"
             "One query row against every cached key (a decode step): q [nh, d], k [kvh, S, d], v [kvh, S, dv] "
             "(rows contiguous, heads strided: a KV cache's view), out [nh, dv]; query head h reads key/value head "
             "h // (nh / kvh); softmax(q k^T * scale) v, float32.");

static PyObject *py_attend_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "attend_row expects 5 arguments, got %zd", nargs);
    const double scale = PyFloat_AsDouble(args[3]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    Py_buffer qv, kv, vv, ov;
    int have_q = 0, have_v = 0, have_o = 0;
    PyObject *result = NULL;
    float *p = NULL;
    Py_ssize_t s, s2, d = 0, dv = 0;
    if (get_heads(args[1], &kv, "k", 0, &s, &d, 0) < 0) return NULL;
    const Py_ssize_t kvh = kv.shape[0];
    if (get_heads(args[2], &vv, "v", kvh, &s2, &dv, 0) < 0) goto done;
    have_v = 1;
    if (s2 != s) {
        PyErr_Format(PyExc_ValueError, "k has %zd positions, v %zd", s, s2);
        goto done;
    }
    if (get_buffer(args[0], &qv, "q", 0) < 0) goto done;
    have_q = 1;
    const Py_ssize_t nh = qv.len / 4 / d;
    if (nh < kvh || nh % kvh || check_buffer(&qv, "q", 'f', 4, nh * d) < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "q: expected [nh, %zd] with nh a multiple of %zd", d, kvh);
        goto done;
    }
    if (get_buffer(args[4], &ov, "out", 1) < 0) goto done;
    have_o = 1;
    if (check_buffer(&ov, "out", 'f', 4, nh * dv) < 0) goto done;
    {
        const Py_buffer *ins[1] = {&qv};
        if (check_disjoint(&ov, ins, 1) < 0) goto done;
        /* k and v are strided views: their extent is from buf to the last row's end */
        const Py_ssize_t kext = (kvh - 1) * kv.strides[0] + s * d * 4, vext = (kvh - 1) * vv.strides[0] + s * dv * 4;
        if (overlaps(&ov, kv.buf, kext) || overlaps(&ov, vv.buf, vext)) {
            PyErr_SetString(PyExc_ValueError, "out overlaps an input");
            goto done;
        }
    }
    p = (float *)malloc((size_t)s * 4 * sizeof(float));
    if (!p) {
        PyErr_NoMemory();
        goto done;
    }
    {
        const Py_ssize_t g = nh / kvh;
        const int release = nh * s * (d + dv) > GIL_WORK;
        PyThreadState *ts = release ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t kh = 0; kh < kvh; kh++)
            attend_group((const float *)qv.buf + kh * g * d, (const float *)((const char *)kv.buf + kh * kv.strides[0]),
                         (const float *)((const char *)vv.buf + kh * vv.strides[0]), g, s, d, dv, (float)scale, p,
                         (float *)ov.buf + kh * g * dv);
        if (release) PyEval_RestoreThread(ts);
    }
    result = Py_NewRef(Py_None);
done:
    free(p);
    if (have_q) PyBuffer_Release(&qv);
    PyBuffer_Release(&kv);
    if (have_v) PyBuffer_Release(&vv);
    if (have_o) PyBuffer_Release(&ov);
    return result;
}

/* ---------------------------------------------------------------- a decode row's layer in two calls */

/* A float32 vector of exactly n items, opened (released by the caller when this returns 0). */
static int get_vector(PyObject *o, Py_buffer *v, const char *name, Py_ssize_t n, int writable) {
    if (get_buffer(o, v, name, writable) < 0) return -1;
    if (check_buffer(v, name, 'f', 4, n) < 0) {
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

typedef struct {
    const void *p;
    Py_ssize_t n;
} span_t;

/* Appends the spans of the held vectors among vec[0..n) and of n_w weights' data and scales to `to`; returns the
 * number appended (n + 2 n_w). */
static Py_ssize_t input_spans(span_t *to, const Py_buffer *vec, const int *held, int n, const weight_t *w,
                              Py_ssize_t n_w) {
    Py_ssize_t m = 0;
    for (int k = 0; k < n; k++) to[m++] = (span_t){held[k] ? vec[k].buf : NULL, held[k] ? vec[k].len : 0};
    for (Py_ssize_t j = 0; j < n_w; j++) {
        to[m++] = (span_t){w[j].wv.buf, w[j].wv.len};
        to[m++] = (span_t){w[j].have_s ? w[j].sv.buf : NULL, w[j].have_s ? w[j].sv.len : 0};
    }
    return m;
}

static void release_held(Py_buffer *vec, const int *held, int n) {
    for (int k = 0; k < n; k++)
        if (held[k]) PyBuffer_Release(&vec[k]);
}

/* -1 with a ValueError when an output span overlaps an input span or another output (each written while the
 * others are read); NULL spans are skipped. */
static int check_spans(const span_t *outs, int n_outs, const span_t *ins, int n_ins) {
    for (int o = 0; o < n_outs; o++) {
        if (!outs[o].p) continue;
        const char *a0 = (const char *)outs[o].p, *a1 = a0 + outs[o].n;
        for (int k = 0; k < n_ins + n_outs; k++) {
            const span_t *b = k < n_ins ? &ins[k] : &outs[k - n_ins];
            if (!b->p || b == &outs[o]) continue;
            const char *b0 = (const char *)b->p, *b1 = b0 + b->n;
            if (a0 < b1 && b0 < a1) {
                PyErr_SetString(PyExc_ValueError, "an output overlaps another buffer");
                return -1;
            }
        }
    }
    return 0;
}

/* y[m, out] = x[m, in] @ W.T, on one thread below GIL_WORK as `product` (needs no GIL); -1 when out of memory */
static int product_rows(const weight_t *w, Py_ssize_t m, const float *x, float *y, int threads) {
    job_t j = job_of(w, m, x, y);
    return run_job(&j, m * w->in + w->out * w->in < GIL_WORK ? 1 : threads);
}

static void add_into(float *y, const float *b, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) y[i] += b[i];
}

/* The attention half of a decode row's layer (see attention_step_doc); scratch holds 2 H + 2 (nh + kvh) d + 4 s
 * floats. Needs no GIL; -1 when out of memory. */
static int attention_row_step(const weight_t *w, const float *const *bias, const float *x, const float *norm,
                              float eps, const float *c, const float *sn, char *kc, Py_ssize_t kstride, char *vc,
                              Py_ssize_t vstride, Py_ssize_t kvh, Py_ssize_t nh, Py_ssize_t d, Py_ssize_t pos,
                              float scale, const float *post, float *h, float *y, float *scratch, int threads) {
    const Py_ssize_t hid = w[0].in, qn = nh * d, kn = kvh * d, g = nh / kvh;
    float *xn = scratch, *q = xn + hid, *k = q + qn, *v = k + kn, *a = v + kn, *o = a + qn, *p = o + hid;
    float *const proj[3] = {q, k, v};
    rms_norm_rows(x, norm, eps, xn, 1, hid);
    for (int j = 0; j < 3; j++) {
        if (product_rows(&w[j], 1, xn, proj[j], threads)) return -1;
        if (bias[j]) add_into(proj[j], bias[j], w[j].out);
    }
    rope_rows(q, c, sn, nh, d);
    rope_rows(k, c, sn, kvh, d);
    for (Py_ssize_t kh = 0; kh < kvh; kh++) { /* this position's keys and values into the caches */
        memcpy(kc + kh * kstride + pos * d * 4, k + kh * d, (size_t)d * 4);
        memcpy(vc + kh * vstride + pos * d * 4, v + kh * d, (size_t)d * 4);
    }
    for (Py_ssize_t kh = 0; kh < kvh; kh++)
        attend_group(q + kh * g * d, (const float *)(kc + kh * kstride), (const float *)(vc + kh * vstride), g, pos + 1,
                     d, d, scale, p, a + kh * g * d);
    if (product_rows(&w[3], 1, a, o, threads)) return -1;
    if (bias[3]) add_into(o, bias[3], hid);
    for (Py_ssize_t i = 0; i < hid; i++) h[i] = x[i] + o[i];
    rms_norm_rows(h, post, eps, y, 1, hid);
    return 0;
}

PyDoc_STRVAR(attention_step_doc,
             "attention_step(x, norm, eps, wq, wk, wv, wo, biases, cos, sin, k_cache, v_cache, pos, scale, post_norm, "
             "h, y, threads) -> None\n\n"
             "One decode row through a layer's GQA self-attention with its norms and residual, the operations of "
             "rms_norm, product, rope, a KV cache's append and attend_row in their order: xn = rms_norm(x, norm); "
             "q, k, v = xn's products (plus their biases); RoPE on q and k; k and v written at position `pos` of the "
             "caches; a = attention of q over positions [0, pos]; h = x + (wo a + its bias); y = rms_norm(h, "
             "post_norm). x, norm, post_norm, h, y: float32 [H]; weights Packed.native tuples, wq [nh * d, H], "
             "wk and wv [kvh * d, H], wo [H, nh * d]; biases a 4-tuple, each None or float32 of its product's width; "
             "cos, sin float32 [d]; k_cache, v_cache writable float32 [kvh, capacity, d] with contiguous rows; "
             "0 <= pos < capacity. Outputs must not overlap anything else: ValueError otherwise.");

enum { AS_X, AS_NORM, AS_EPS, AS_WQ, AS_WK, AS_WV, AS_WO, AS_BIAS, AS_COS, AS_SIN, AS_KC, AS_VC, AS_POS, AS_SCALE,
       AS_POST, AS_H, AS_Y, AS_THREADS, AS_COUNT };

static PyObject *py_attention_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != AS_COUNT)
        return PyErr_Format(PyExc_TypeError, "attention_step expects %d arguments, got %zd", AS_COUNT, nargs);
    const double eps = PyFloat_AsDouble(args[AS_EPS]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    const double scale = PyFloat_AsDouble(args[AS_SCALE]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    Py_ssize_t pos;
    int threads;
    if (get_int(args[AS_POS], "pos", &pos) < 0 || get_threads(args[AS_THREADS], &threads) < 0) return NULL;
    PyObject *biases = args[AS_BIAS];
    if (!PyTuple_Check(biases) || PyTuple_GET_SIZE(biases) != 4)
        return PyErr_Format(PyExc_TypeError, "biases: expected a tuple of 4");
    /* vectors: x, norm, post_norm, cos, sin, 4 biases (inputs), then h, y (outputs) */
    enum { V_X, V_NORM, V_POST, V_COS, V_SIN, V_BQ, V_BK, V_BV, V_BO, V_H, V_Y, V_COUNT };
    weight_t w[4];
    Py_buffer vec[V_COUNT], kc, vc;
    int held[V_COUNT] = {0}, opened = 0, have_kc = 0, have_vc = 0;
    float *scratch = NULL;
    PyObject *result = NULL;
    static const char *const wnames[4] = {"wq", "wk", "wv", "wo"};
    for (; opened < 4; opened++)
        if (weight_open_tuple(&w[opened], args[AS_WQ + opened], wnames[opened]) < 0) goto done;
    Py_ssize_t s, d = 0, cap2;
    if (get_heads(args[AS_KC], &kc, "k_cache", 0, &s, &d, 1) < 0) goto done;
    have_kc = 1;
    const Py_ssize_t kvh = kc.shape[0], hid = w[0].in;
    if (get_heads(args[AS_VC], &vc, "v_cache", kvh, &cap2, &d, 1) < 0) goto done;
    have_vc = 1;
    const Py_ssize_t nh = w[0].out / d;
    if (cap2 != s || d < 2 || d % 2 || w[0].out % d || nh < kvh || nh % kvh || w[1].out != kvh * d ||
        w[2].out != kvh * d || w[1].in != hid || w[2].in != hid || w[3].in != nh * d || w[3].out != hid ||
        pos < 0 || pos >= s) {
        PyErr_Format(PyExc_ValueError,
                     "attention_step: wq [%zd, %zd], wk [%zd, %zd], wv [%zd, %zd], wo [%zd, %zd], caches of %zd and "
                     "%zd positions of [%zd, %zd], pos %zd do not fit together",
                     w[0].out, w[0].in, w[1].out, w[1].in, w[2].out, w[2].in, w[3].out, w[3].in, s, cap2, kvh, d,
                     pos);
        goto done;
    }
    {
        static const char *const vnames[V_COUNT] = {"x", "norm", "post_norm", "cos", "sin", "bq", "bk", "bv", "bo",
                                                    "h", "y"};
        PyObject *const vobj[V_COUNT] = {args[AS_X], args[AS_NORM], args[AS_POST], args[AS_COS], args[AS_SIN],
                                         PyTuple_GET_ITEM(biases, 0), PyTuple_GET_ITEM(biases, 1),
                                         PyTuple_GET_ITEM(biases, 2), PyTuple_GET_ITEM(biases, 3), args[AS_H],
                                         args[AS_Y]};
        const Py_ssize_t vlen[V_COUNT] = {hid, hid, hid, d, d, w[0].out, w[1].out, w[2].out, w[3].out, hid, hid};
        for (int k = 0; k < V_COUNT; k++) {
            if (k >= V_BQ && k <= V_BO && vobj[k] == Py_None) continue;
            if (get_vector(vobj[k], &vec[k], vnames[k], vlen[k], k >= V_H) < 0) goto done;
            held[k] = 1;
        }
    }
    {
        span_t ins[V_H + 8], outs[4];
        const int n = (int)input_spans(ins, vec, held, V_H, w, 4);
        outs[0] = (span_t){vec[V_H].buf, vec[V_H].len};
        outs[1] = (span_t){vec[V_Y].buf, vec[V_Y].len};
        outs[2] = (span_t){kc.buf, (kvh - 1) * kc.strides[0] + s * d * 4};
        outs[3] = (span_t){vc.buf, (kvh - 1) * vc.strides[0] + s * d * 4};
        if (check_spans(outs, 4, ins, n) < 0) goto done;
    }
    scratch = (float *)malloc((size_t)(2 * hid + 2 * (nh + kvh) * d + 4 * (pos + 1)) * sizeof(float));
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    {
        const float *bias[4];
        for (int j = 0; j < 4; j++) bias[j] = held[V_BQ + j] ? (const float *)vec[V_BQ + j].buf : NULL;
        /* the products' weights and the keys and values attended to */
        const int release = (nh + 2 * kvh) * d * hid + hid * nh * d + nh * (pos + 1) * 2 * d >= GIL_WORK;
        int rc;
        pool_after_fork_check();
        PyThreadState *ts = release ? PyEval_SaveThread() : NULL;
        rc = attention_row_step(w, bias, (const float *)vec[V_X].buf, (const float *)vec[V_NORM].buf, (float)eps,
                                (const float *)vec[V_COS].buf, (const float *)vec[V_SIN].buf, (char *)kc.buf,
                                kc.strides[0], (char *)vc.buf, vc.strides[0], kvh, nh, d, pos, (float)scale,
                                (const float *)vec[V_POST].buf, (float *)vec[V_H].buf, (float *)vec[V_Y].buf, scratch,
                                threads);
        if (release) PyEval_RestoreThread(ts);
        if (rc) {
            PyErr_NoMemory();
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    free(scratch);
    release_held(vec, held, V_COUNT);
    if (have_kc) PyBuffer_Release(&kc);
    if (have_vc) PyBuffer_Release(&vc);
    for (int k = 0; k < opened; k++) weight_release(&w[k]);
    return result;
}

PyDoc_STRVAR(moe_row_doc,
             "moe_row(x, experts, gates, shared, h, out, threads) -> None\n\n"
             "A decode row's routed experts, shared expert and residual, as the numpy path sums them: each expert's "
             "swiglu(x) times its gate, summed in the order given (float32, the first as it is), plus `shared`, "
             "then out = h + that sum. x, h, out: float32 [H]; experts a tuple of (gate, up, down) Packed.native "
             "tuples as swiglu takes; gates float32 [len(experts)]; shared None or float32 [H]. out must not overlap "
             "anything else: ValueError otherwise.");

static PyObject *py_moe_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "moe_row expects 7 arguments, got %zd", nargs);
    int threads;
    if (get_threads(args[6], &threads) < 0) return NULL;
    PyObject *experts = args[1];
    if (!PyTuple_Check(experts) || PyTuple_GET_SIZE(experts) < 1 || PyTuple_GET_SIZE(experts) > MAX_TOP_K)
        return PyErr_Format(PyExc_TypeError, "experts: expected a tuple of 1 to %d (gate, up, down) tuples",
                            MAX_TOP_K);
    const Py_ssize_t n = PyTuple_GET_SIZE(experts);
    enum { V_X, V_GATES, V_SHARED, V_H, V_OUT, V_COUNT };
    Py_buffer vec[V_COUNT];
    int held[V_COUNT] = {0};
    Py_ssize_t opened = 0;
    float *acc = NULL, *tmp = NULL;
    span_t *ins = NULL;
    PyObject *result = NULL;
    weight_t *w = (weight_t *)calloc((size_t)(3 * n), sizeof(weight_t));
    if (!w) return PyErr_NoMemory();
    static const char *const names[3] = {"gate", "up", "down"};
    for (Py_ssize_t e = 0; e < n; e++) {
        PyObject *t = PyTuple_GET_ITEM(experts, e);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
            PyErr_Format(PyExc_TypeError, "experts[%zd]: expected a (gate, up, down) tuple", e);
            goto done;
        }
        for (int j = 0; j < 3; j++, opened++)
            if (weight_open_tuple(&w[opened], PyTuple_GET_ITEM(t, j), names[j]) < 0) goto done;
        const weight_t *x = &w[3 * e];
        if (x[1].in != x[0].in || x[1].out != x[0].out || x[2].in != x[0].out || x[2].out != x[0].in ||
            x[0].in != w[0].in) {
            PyErr_Format(PyExc_ValueError, "experts[%zd]: gate [%zd, %zd], up [%zd, %zd], down [%zd, %zd] do not chain "
                         "from a width of %zd", e, x[0].out, x[0].in, x[1].out, x[1].in, x[2].out, x[2].in, w[0].in);
            goto done;
        }
    }
    const Py_ssize_t hid = w[0].in;
    {
        static const char *const vnames[V_COUNT] = {"x", "gates", "shared", "h", "out"};
        const Py_ssize_t vlen[V_COUNT] = {hid, n, hid, hid, hid};
        static const int argi[V_COUNT] = {0, 2, 3, 4, 5}; /* each vector's argument (1 is experts) */
        for (int k = 0; k < V_COUNT; k++) {
            if (k == V_SHARED && args[3] == Py_None) continue;
            if (get_vector(args[argi[k]], &vec[k], vnames[k], vlen[k], k == V_OUT) < 0)
                goto done;
            held[k] = 1;
        }
    }
    ins = (span_t *)malloc((size_t)(6 * n + V_OUT) * sizeof(span_t));
    if (!ins) {
        PyErr_NoMemory();
        goto done;
    }
    {
        const Py_ssize_t m = input_spans(ins, vec, held, V_OUT, w, 3 * n);
        const span_t out = {vec[V_OUT].buf, vec[V_OUT].len};
        if (check_spans(&out, 1, ins, (int)m) < 0) goto done;
    }
    acc = (float *)malloc((size_t)hid * sizeof(float));
    tmp = (float *)malloc((size_t)hid * sizeof(float));
    if (!acc || !tmp) {
        PyErr_NoMemory();
        goto done;
    }
    {
        const float *x = (const float *)vec[V_X].buf, *gates = (const float *)vec[V_GATES].buf;
        const float *shared = held[V_SHARED] ? (const float *)vec[V_SHARED].buf : NULL;
        const float *h = (const float *)vec[V_H].buf;
        float *out = (float *)vec[V_OUT].buf;
        int rc = 0;
        pool_after_fork_check();
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t e = 0; e < n && !rc; e++) {
            rc = swiglu_rows(&w[3 * e], x, e ? tmp : acc, 1, threads);
            if (rc) break;
            const float ge = gates[e];
            if (e == 0) {
                for (Py_ssize_t i = 0; i < hid; i++) acc[i] *= ge;
            } else {
                for (Py_ssize_t i = 0; i < hid; i++) {
                    const float t = tmp[i] * ge; /* rounded to float32 before the add, as numpy's two steps (the
                                                  * build's -ffp-contract=off keeps the compiler from fusing them) */
                    acc[i] += t;
                }
            }
        }
        if (!rc) {
            if (shared) add_into(acc, shared, hid);
            for (Py_ssize_t i = 0; i < hid; i++) out[i] = h[i] + acc[i];
        }
        Py_END_ALLOW_THREADS
        if (rc) {
            PyErr_NoMemory();
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    free(acc);
    free(tmp);
    free(ins);
    release_held(vec, held, V_COUNT);
    for (Py_ssize_t k = 0; k < opened; k++) weight_release(&w[k]);
    free(w);
    return result;
}

#define SCAN_GIL_BYTES (1 << 20) /* buffers below this are scanned keeping the GIL */

PyDoc_STRVAR(nonfinite_doc,
             "nonfinite(kind, data) -> int\n\n"
             "The index (in C order) of the first non-finite element of `data` stored as `kind`: f32 ('f'), f16 "
             "('e'), bf16 (uint16 'H' view) or fp8 (uint8 'B' view; 0x7F/0xFF are NaN), or -1 when all are finite. "
             "One pass, the GIL released for large buffers. `data` must be C-contiguous, of that format and aligned: "
             "ValueError otherwise.");

static PyObject *py_nonfinite(PyObject *self, PyObject *args) {
    (void)self;
    const char *kind_s;
    PyObject *o;
    if (!PyArg_ParseTuple(args, "sO:nonfinite", &kind_s, &o)) return NULL;
    int kind = kind_of(kind_s);
    char want;
    Py_ssize_t size;
    switch (kind) {
    case K_F32: want = 'f'; size = 4; break;
    case K_F16: want = 'e'; size = 2; break;
    case K_BF16: want = 'H'; size = 2; break;
    case K_FP8: want = 'B'; size = 1; break;
    default: return PyErr_Format(PyExc_ValueError, "nonfinite: kind %R is not f32, f16, bf16 or fp8",
                                 PyTuple_GET_ITEM(args, 0));
    }
    Py_buffer v;
    if (get_buffer(o, &v, "data", 0) < 0) return NULL;
    Py_ssize_t at = -1;
    if (check_buffer(&v, "data", want, size, v.len / size) < 0) {
        PyBuffer_Release(&v);
        return NULL;
    }
    const Py_ssize_t n = v.len / size;
    const int avx2 = cpu_simd != SIMD_PLAIN;
    if (v.len < SCAN_GIL_BYTES) {
        at = find_nonfinite(kind, (const uint8_t *)v.buf, n, avx2);
    } else {
        Py_BEGIN_ALLOW_THREADS
        at = find_nonfinite(kind, (const uint8_t *)v.buf, n, avx2);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(at);
}

/* The best kernels this CPU runs. */
static int best_simd(void) {
#if HAVE_X86_KERNELS
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return SIMD_PLAIN;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? SIMD_AVX512 : SIMD_AVX2;
#else
    return SIMD_PLAIN;
#endif
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(SIMD_NAMES[cpu_simd]);
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    int want;
    if (PyUnicode_Check(arg)) {
        Py_ssize_t size;
        const char *name = PyUnicode_AsUTF8AndSize(arg, &size);
        if (!name) return NULL;
        for (want = 0; want <= SIMD_AVX512; want++)
            if ((size_t)size == strlen(SIMD_NAMES[want]) && memcmp(name, SIMD_NAMES[want], (size_t)size) == 0) break;
        if (want > SIMD_AVX512) return PyErr_Format(PyExc_ValueError, "use_simd: expected 'plain', 'avx2' or "
                                                                      "'avx512', found %R", arg);
    } else if (PyBool_Check(arg)) {
        want = arg == Py_True ? SIMD_AVX512 : SIMD_PLAIN;
    } else {
        return PyErr_Format(PyExc_TypeError, "use_simd: expected a bool or 'plain', 'avx2' or 'avx512', found %R", arg);
    }
    const int best = best_simd();
    cpu_simd = want < best ? want : best;
    return PyUnicode_FromString(SIMD_NAMES[cpu_simd]);
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, matmul_doc},
    {"product", (PyCFunction)(void (*)(void))py_product, METH_FASTCALL, product_doc},
    {"swiglu", (PyCFunction)(void (*)(void))py_swiglu, METH_FASTCALL, swiglu_doc},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, rms_norm_doc},
    {"route_softmax", (PyCFunction)(void (*)(void))py_route_softmax, METH_FASTCALL, route_softmax_doc},
    {"attend_row", (PyCFunction)(void (*)(void))py_attend_row, METH_FASTCALL, attend_row_doc},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL, rope_doc},
    {"attention_step", (PyCFunction)(void (*)(void))py_attention_step, METH_FASTCALL, attention_step_doc},
    {"moe_row", (PyCFunction)(void (*)(void))py_moe_row, METH_FASTCALL, moe_row_doc},
    {"nonfinite", py_nonfinite, METH_VARARGS, nonfinite_doc},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use: 'avx512', 'avx2' or 'plain'."},
    {"use_simd", py_set_isa, METH_O,
     "use_simd(level) -> isa: True (the default) for the best kernels the CPU has, False or 'plain' for the plain C "
     "ones, 'avx2' or 'avx512' for at most those (for tests and benchmarks); returns the instruction set now in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Native x @ W.T with W in its stored dtype (see runtime/model/_packed.py).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    init_tables();
    pool_pid = getpid();
#if HAVE_X86_KERNELS
    __builtin_cpu_init();
#endif
    cpu_simd = best_simd();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_TOP_K", MAX_TOP_K) < 0) Py_CLEAR(m);
    return m;
}
