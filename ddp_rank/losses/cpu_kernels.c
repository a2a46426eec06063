/* The losses' passes over a block of a chunk's rows on CPU, each one loop over a row (float32): FastAP's
 * cumulative histograms and bin gradient, and the sigmoid ranks of PNP and Smooth-AP and their gradient.
 *
 * Compiled on the machine that runs them, for its own CPU, by ddp_rank/losses/cpu_kernels.py, and called
 * through ctypes on ranges of rows (a range per thread). Each function computes what the torch path in
 * histogram.py or sigmoid_ranks.py computes; the tests hold them to it.
 *
 * Written with GCC's vector extensions (GCC and clang take them, and lower them to whatever vectors the CPU
 * has): a vector of floats at a time, selects by bit masks, columns in tiles of TILE that stay in the core's first
 * cache. Sums go to CHAINS independent vector accumulators (an add never waits on the one before it), each
 * tile's sum to a double, so a row's sum keeps float32's digits at any N.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 2048
#define CHAINS 4

/* 8 floats where the CPU has 256-bit vectors, 4 elsewhere (SSE2, NEON): a vector wider than the CPU's is
 * split into scalar code by the compiler, not into two vectors. */
#if defined(__AVX__)
#include <immintrin.h>
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
            /* Comparisons a NaN fails fall to the widest range (a NaN position reads 0, as outside [0, num_bins]). */
            const int first = lo > 0.f ? (lo < top ? (int)lo : num_bins - 1) : 0;
            const int last = hi < top ? (hi > 0.f ? (int)hi : 0) : num_bins - 1;
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

/* exp(x) for x in [-87, 88], to about 2 ulp, in vector operations only: x = n ln2 + f with |f| <= ln2 / 2, a
 * degree-6 polynomial for exp(f) and 2^n from the exponent's bits (n rounded by adding and subtracting
 * 1.5 * 2^23, which IEEE arithmetic does exactly in round-to-nearest). */
static inline vf exp_range(vf x) {
    const float round = 12582912.f;
    const vf n = (x * 1.44269504088896341f + round) - round;
    const vf f = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

static inline vf clamp(vf x, float lo, float hi) {
    x = pick(x < splat(lo), splat(lo), x);
    return pick(x > splat(hi), splat(hi), x);
}

/* 1 / u for u >= 1: the CPU's reciprocal estimate and a Newton step (1 - 2 ulp) where it has one. */
static inline vf reciprocal(vf u) {
#if defined(__AVX__)
    const vf r = (vf)_mm256_rcp_ps((__m256)u);
    return r * (2.f - u * r);
#else
    return 1.f / u;
#endif
}

/* s = keep / (1 + ex), added to *acc, s (1 - s) to *dacc and written at d[at] with d. 1 - s is taken as ex s,
 * which does not cancel where s is near 1 (s - s * s would leave only rounding there). */
static inline void add_sigmoid(vf ex, vf keep, vf *acc, vf *dacc, float *d, int64_t at) {
    const vf s = reciprocal(ex + 1.f) * keep;
    const vf ds = s * (ex * s);
    *acc += s;
    *dacc += ds;
    if (d) store(d + at, ds);
}

/* Positives whose scores lie within RANGE of the highest among them share one exponential per column. */
#define RANGE 40.f

/* One row's sigmoid ranks over a tile x[0..n) of TILE columns (n a multiple of CHAINS * W, masked columns -inf):
 * rank[i] += sum_j sigmoid(x[j] - q[i]), slope[i] += sum_j s (1 - s), and d[i * stride_d + j] = s (1 - s) with d.
 *
 * sigmoid(x - q) = 1 / (1 + e^(q - x)) and e^(q - x) = e^(q - c) e^(c - x). The positives go in groups, each
 * the highest positive left, c, and every other within RANGE of it; a group takes one exponential per column,
 * e^(c - x), and each of its positives a multiply and a reciprocal per column. e^(c - x) is taken at c - x
 * clamped to [-47, 87]: below -47 every such sigmoid is 1 to float32's precision either way (1 - e^-47, with
 * e^-47 < 2^-24); above 87, where e^(c - x) would overflow, both it and the exact sigmoid are below
 * e^-(87 - RANGE) = 4e-21. The -inf of a masked column gives exactly 0 (a 0/1 factor). */
static void rank_tile(const float *x, int64_t n, const float *q, int32_t p, double *rank, double *slope,
                      float *d, int64_t stride_d, float *e, float *keep) {
    for (int64_t j = 0; j < n; j += W) store(keep + j, pick(load(x + j) > splat(-INFINITY), splat(1.f), splat(0.f)));
    unsigned char done[p > 0 ? p : 1];
    memset(done, 0, sizeof done);
    for (;;) {
        int top = -1;
        for (int i = 0; i < p; ++i)
            if (!done[i] && (top < 0 || q[i] > q[top])) top = i;
        if (top < 0) return;
        const float c = q[top];
        for (int64_t j = 0; j < n; j += W) store(e + j, exp_range(clamp(c - load(x + j), -47.f, 87.f)));
        for (int i = 0; i < p; ++i) {
            if (done[i] || q[i] - c < -RANGE) continue;
            done[i] = 1;
            const vf a = exp_range(splat(q[i] - c));
            float *di = d ? d + i * stride_d : 0;
            vf acc[CHAINS], dacc[CHAINS];
            for (int k = 0; k < CHAINS; ++k) acc[k] = dacc[k] = splat(0.f);
            for (int64_t j = 0; j < n; j += CHAINS * W)
                for (int k = 0; k < CHAINS; ++k)
                    add_sigmoid(a * load(e + j + k * W), load(keep + j + k * W), &acc[k], &dacc[k], di, j + k * W);
            for (int k = 0; k < CHAINS; ++k) {
                rank[i] += (double)lanes_sum(acc[k]);
                slope[i] += (double)lanes_sum(dacc[k]);
            }
        }
    }
}

/* ranks[r, i] = sum_j sigmoid(scores[r, j] - same[r, i]) and slope_sums[r, i] = sum_j s (1 - s) ([rows, p]),
 * masked columns holding -inf; with dsigma (else NULL), also dsigma[r, i, j] = s (1 - s) ([rows, p, cols]). */
void sigmoid_rank_sums_f32(const float *scores, int64_t rows, int64_t cols, int64_t stride, const float *same,
                           int32_t p, float *ranks, float *slope_sums, float *dsigma) {
    float e[TILE], keep[TILE], x[TILE], d_tail[TILE];
    double rank[p > 0 ? p : 1], slope[p > 0 ? p : 1];
    const int64_t step = CHAINS * W;
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = scores + r * stride;
        const float *q = same + r * p;
        for (int i = 0; i < p; ++i) rank[i] = slope[i] = 0.0;
        float *d = dsigma ? dsigma + r * p * cols : 0;
        const int64_t body = cols - cols % step;
        for (int64_t start = 0; start < body; start += TILE) {
            const int64_t n = body - start < TILE ? body - start : TILE;
            rank_tile(row + start, n, q, p, rank, slope, d ? d + start : 0, cols, e, keep);
        }
        if (body < cols) { /* the last columns, padded with masked ones (exactly 0) to a whole step */
            const int64_t n = cols - body;
            for (int64_t j = 0; j < step; ++j) x[j] = j < n ? row[body + j] : -INFINITY;
            for (int i = 0; i < p; ++i) {
                rank_tile(x, step, q + i, 1, rank + i, slope + i, d ? d_tail : 0, 0, e, keep);
                if (d) memcpy(d + i * cols + body, d_tail, n * sizeof(float));
            }
        }
        for (int i = 0; i < p; ++i) {
            ranks[r * p + i] = (float)rank[i];
            slope_sums[r * p + i] = (float)slope[i];
        }
    }
}

/* out[r, j] = sum_i w[r, i] dsigma[r, i, j] ([rows, cols], out's rows at stride_out; out may be the scores). */
void sigmoid_rank_gradient_f32(const float *dsigma, const float *w, int64_t rows, int64_t cols, int32_t p,
                               float *out, int64_t stride_out) {
    for (int64_t r = 0; r < rows; ++r) {
        float *o = out + r * stride_out;
        const float *d = dsigma + r * p * cols;
        const float *wr = w + r * p;
        int64_t j = 0;
        for (; j + W <= cols; j += W) {
            vf g = splat(0.f);
            for (int i = 0; i < p; ++i) g += wr[i] * load(d + i * cols + j);
            store(o + j, g);
        }
        for (; j < cols; ++j) {
            float g = 0.f;
            for (int i = 0; i < p; ++i) g += wr[i] * d[i * cols + j];
            o[j] = g;
        }
    }
}
