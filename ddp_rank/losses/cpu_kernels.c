/* FastAP's passes over a block of bin positions on CPU, each one loop over a row (float32).
 *
 * Compiled on the machine that runs them, for its own CPU, by ddp_rank/losses/cpu_kernels.py, and called
 * through ctypes on ranges of rows (a range per thread). Each function computes what the torch path in
 * histogram.py computes; the tests hold them to it.
 *
 * Written with GCC's vector extensions (GCC and clang take them, and lower them to whatever vectors the CPU
 * has): a vector of floats at a time, selects by bit masks, columns in tiles of TILE that stay in the core's first
 * cache. Sums go to CHAINS independent vector accumulators (an add never waits on the one before it), each
 * tile's sum to a double, so a row's sum keeps float32's digits at any N.
 */
#include <stdint.h>
#include <string.h>

#define TILE 2048
#define CHAINS 4

/* 8 floats where the CPU has 256-bit vectors, 4 elsewhere (SSE2, NEON): a vector wider than the CPU's is
 * split into scalar code by the compiler, not into two vectors. */
#if defined(__AVX__)
#define VECTOR_BYTES 32
#else
#define VECTOR_BYTES 16
#endif
typedef float vf __attribute__((vector_size(VECTOR_BYTES)));
typedef int32_t vi __attribute__((vector_size(VECTOR_BYTES)));
#define W ((int64_t)(VECTOR_BYTES / sizeof(float)))

static inline vf load(const float *x) {
    vf v;
    memcpy(&v, x, sizeof v);
    return v;
}

static inline void store(float *x, vf v) { memcpy(x, &v, sizeof v); }

static inline vf splat(float a) {
    const vf zero = {0.f};
    return zero + a;
}

/* a where mask (all bits set), else b. */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline float lanes_sum(vf v) {
    float s = 0.f;
    for (int k = 0; k < W; ++k) s += v[k];
    return s;
}

static inline float clamp01(float c) { return c < 0.f ? 0.f : (c > 1.f ? 1.f : c); }

/* The least and the greatest of x[0..n), 0 < n <= TILE. */
static void tile_range(const float *x, int64_t n, float *lo, float *hi) {
    float mn = x[0], mx = x[0];
    int64_t j = 0;
    if (n >= W) {
        vf vmn = load(x), vmx = vmn;
        for (; j + W <= n; j += W) {
            const vf v = load(x + j);
            vmn = pick(v < vmn, v, vmn);
            vmx = pick(v > vmx, v, vmx);
        }
        for (int k = 0; k < W; ++k) {
            mn = vmn[k] < mn ? vmn[k] : mn;
            mx = vmx[k] > mx ? vmx[k] : mx;
        }
    }
    for (; j < n; ++j) {
        mn = x[j] < mn ? x[j] : mn;
        mx = x[j] > mx ? x[j] : mx;
    }
    *lo = mn;
    *hi = mx;
}

/* sum_j clamp(level - x[j], 0, 1) over a tile. */
static double level_sum(const float *x, int64_t n, float level) {
    const vf vlevel = splat(level), zero = splat(0.f), one = splat(1.f);
    vf acc[CHAINS];
    for (int c = 0; c < CHAINS; ++c) acc[c] = zero;
    int64_t j = 0;
    for (; j + CHAINS * W <= n; j += CHAINS * W)
        for (int c = 0; c < CHAINS; ++c) {
            vf v = vlevel - load(x + j + c * W);
            v = pick(v < zero, zero, v);
            acc[c] += pick(v > one, one, v);
        }
    float s = 0.f;
    for (; j < n; ++j) s += clamp01(level - x[j]);
    for (int c = 0; c < CHAINS; ++c) s += lanes_sum(acc[c]);
    return (double)s;
}

/* out[r, l] = sum_j clamp(l + 1 - t[r, j], 0, 1), l = 0..num_bins ([rows, num_bins + 1]).
 *
 * Per tile, the levels every position saturates are not computed: clamp(l + 1 - t) is exactly 0 when
 * l + 1 <= min t and exactly 1 when l >= max t. */
void cumulative_histograms_f32(const float *t, int64_t rows, int64_t cols, int64_t stride, int32_t num_bins,
                               float *out) {
    double total[num_bins > 0 ? num_bins : 1];
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = t + r * stride;
        for (int l = 0; l < num_bins; ++l) total[l] = 0.0;
        for (int64_t start = 0; start < cols; start += TILE) {
            const int64_t n = cols - start < TILE ? cols - start : TILE;
            float lo, hi;
            tile_range(row + start, n, &lo, &hi);
            for (int l = 0; l < num_bins; ++l) {
                const float level = (float)(l + 1);
                if (level - 1.f >= hi)
                    total[l] += (double)n;
                else if (level > lo)
                    total[l] += level_sum(row + start, n, level);
            }
        }
        float *o = out + r * (num_bins + 1);
        for (int l = 0; l < num_bins; ++l) o[l] = (float)total[l];
        o[num_bins] = (float)cols;
    }
}

/* out[r, j] = slopes[r, min(floor(t[r, j]), num_bins - 1)] where 0 <= t[r, j] <= num_bins, else 0.
 *
 * out may be t itself: a tile is read whole before it is written. Per tile, only the bins between its least
 * and its greatest position are compared. */
void bin_gradient_f32(const float *t, int64_t rows, int64_t cols, int64_t stride_t, const float *slopes,
                      int32_t num_bins, float *out, int64_t stride_out) {
    const float top = (float)num_bins;
    const vf zero = splat(0.f), vtop = splat(top);
    float g[TILE];
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = t + r * stride_t;
        const float *s = slopes + r * num_bins;
        float *o = out + r * stride_out;
        for (int64_t start = 0; start < cols; start += TILE) {
            const int64_t n = cols - start < TILE ? cols - start : TILE;
            const int64_t body = n - n % W;
            const float *x = row + start;
            float lo, hi;
            tile_range(x, n, &lo, &hi);
            const int first = lo <= 0.f ? 0 : (lo >= top ? num_bins - 1 : (int)lo);
            const int last = hi >= top ? num_bins - 1 : (hi <= 0.f ? 0 : (int)hi);
            for (int64_t j = 0; j < n; ++j) g[j] = s[first];
            for (int l = first + 1; l <= last; ++l) {
                const vf level = splat((float)l), slope = splat(s[l]);
                for (int64_t j = 0; j < body; j += W) store(g + j, pick(load(x + j) >= level, slope, load(g + j)));
                for (int64_t j = body; j < n; ++j) g[j] = x[j] >= (float)l ? s[l] : g[j];
            }
            float *y = o + start;
            for (int64_t j = 0; j < body; j += W) {
                const vf v = load(x + j);
                store(y + j, pick((v >= zero) & (v <= vtop), load(g + j), zero));
            }
            for (int64_t j = body; j < n; ++j) y[j] = (x[j] >= 0.f && x[j] <= top) ? g[j] : 0.f;
        }
    }
}
