/* The CPU path's fused loops: Sinkhorn-Knopp with its exact backward, and the site's pre-mix and
 * post-mix with their backwards. fp32, contiguous, row-major; the Python side checks the layouts.
 *
 * Each function does in one pass over memory what the PyTorch reference does in dozens of small
 * ops (mhc/reference.py, mhc/sites.py), the same steps per value, so that results agree with the
 * reference within fp32 rounding; Sinkhorn's steps multiply by the reciprocal sum, as the GPU
 * kernels do, where the reference divides. Sinkhorn works on blocks of BLOCK
 * tokens with the token index innermost: the compiler turns every loop over a block into vector
 * instructions, and a block's iterates stay in cache for the backward, which recomputes them
 * (only the logits are saved, as on the GPU). Built by mhc/cpu/_build.py at first use. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
#endif

#define BLOCK 16
#define LANES 8
/* work below these sizes runs on one thread: waking the team costs more than it saves */
#define PARALLEL_BLOCKS 4
#define PARALLEL_FLOATS 16384

/* sum_k a[k] b[k] in LANES partial sums: independent lanes vectorise without reassociating */
static float dot(const float *a, const float *b, int64_t d) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= d; k += LANES)
        for (int64_t l = 0; l < LANES; l++) acc[l] += a[k + l] * b[k + l];
    float total = 0.0f;
    for (int64_t l = 0; l < LANES; l++) total += acc[l];
    for (; k < d; k++) total += a[k] * b[k];
    return total;
}

/* exp(x) for x <= 0 or NaN (softmax arguments, x - max), in plain arithmetic so that loops over
 * a block vectorise (expf is a library call): x = k ln 2 + r with |r| <= ln 2 / 2, a degree-6
 * polynomial for exp(r) (Cephes' expf, within 2 ulp of expf), times 2^k built in the exponent
 * bits. Below -87.33 (where exp is below FLT_MIN) it returns 0, and exp(-inf) = 0 exactly. */
static inline float exp_nonpositive(float x) {
    const float lowest = -87.33654f; /* ln(FLT_MIN) */
    float clamped = x < lowest ? lowest : x; /* NaN stays NaN */
    float k = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = (clamped - k * 0.693359375f) - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23; /* 2^k, k in [-126, 0] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < lowest ? 0.0f : p * scale;
}

/* entry (r, c) of token b in a block: m[(r * n + c) * BLOCK + b] */
#define AT(m, r, c) ((m) + ((r) * n + (c)) * BLOCK)

/* max that keeps a NaN, as torch.amax does (fmaxf drops it, and is a library call) */
static inline float max_nan(float top, float v) { return (v > top || v != v) ? v : top; }

static void load_block(float *dst, const float *src, int64_t t0, int64_t count, int64_t n) {
    int64_t nn = n * n;
    for (int64_t b = 0; b < BLOCK; b++) {
        /* past the last token: zeros (a uniform matrix), computed and never stored */
        const float *row = b < count ? src + (t0 + b) * nn : NULL;
        for (int64_t k = 0; k < nn; k++) dst[k * BLOCK + b] = row ? row[k] : 0.0f;
    }
}

static void store_block(float *dst, const float *src, int64_t t0, int64_t count, int64_t n) {
    int64_t nn = n * n;
    for (int64_t b = 0; b < count; b++)
        for (int64_t k = 0; k < nn; k++) dst[(t0 + b) * nn + k] = src[k * BLOCK + b];
}

/* out = softmax of z along one axis of every matrix (out may be z): columns = 1 normalises each
 * column c over its rows r, columns = 0 each row over its columns */
static void softmax_along(const float *z, float *out, int64_t n, int columns) {
    for (int64_t i = 0; i < n; i++) {
        float top[BLOCK], sum[BLOCK];
        for (int64_t b = 0; b < BLOCK; b++) top[b] = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            const float *v = columns ? AT(z, j, i) : AT(z, i, j);
            for (int64_t b = 0; b < BLOCK; b++) top[b] = max_nan(top[b], v[b]);
        }
        for (int64_t b = 0; b < BLOCK; b++) sum[b] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *v = columns ? AT(z, j, i) : AT(z, i, j);
            float *w = columns ? AT(out, j, i) : AT(out, i, j);
            for (int64_t b = 0; b < BLOCK; b++) {
                w[b] = exp_nonpositive(v[b] - top[b]);
                sum[b] += w[b];
            }
        }
        for (int64_t j = 0; j < n; j++) {
            float *w = columns ? AT(out, j, i) : AT(out, i, j);
            for (int64_t b = 0; b < BLOCK; b++) w[b] /= sum[b];
        }
    }
}

/* m = softmax over columns c of each row of (logits - logsumexp over rows): the first iteration
 * in the log domain (mhc.reference._first_iteration_at) */
static void first_iteration(const float *logits, float *m, int64_t n) {
    for (int64_t c = 0; c < n; c++) {
        float top[BLOCK], lse[BLOCK];
        for (int64_t b = 0; b < BLOCK; b++) top[b] = -INFINITY;
        for (int64_t r = 0; r < n; r++)
            for (int64_t b = 0; b < BLOCK; b++) top[b] = max_nan(top[b], AT(logits, r, c)[b]);
        for (int64_t b = 0; b < BLOCK; b++) lse[b] = 0.0f;
        for (int64_t r = 0; r < n; r++)
            for (int64_t b = 0; b < BLOCK; b++) lse[b] += exp_nonpositive(AT(logits, r, c)[b] - top[b]);
        for (int64_t b = 0; b < BLOCK; b++) lse[b] = isinf(top[b]) ? top[b] : top[b] + logf(lse[b]);
        for (int64_t r = 0; r < n; r++)
            for (int64_t b = 0; b < BLOCK; b++) AT(m, r, c)[b] = AT(logits, r, c)[b] - lse[b];
    }
    softmax_along(m, m, n, 0);
}

/* after = before / (sum of before along the step's axis + eps), as a product by the reciprocal
 * (as the GPU kernels scale); inverse [n][BLOCK] keeps the reciprocals. columns: the sums run
 * over rows r, one per column c; rows: over columns. */
static void divide_step(const float *restrict before, float *restrict after, float *restrict inverse, int64_t n,
                        int columns, float eps) {
    for (int64_t i = 0; i < n; i++) {
        float sum[BLOCK];
        for (int64_t b = 0; b < BLOCK; b++) sum[b] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *v = columns ? AT(before, j, i) : AT(before, i, j);
            for (int64_t b = 0; b < BLOCK; b++) sum[b] += v[b];
        }
        for (int64_t b = 0; b < BLOCK; b++) sum[b] = 1.0f / (sum[b] + eps);
        for (int64_t j = 0; j < n; j++) {
            const float *v = columns ? AT(before, j, i) : AT(before, i, j);
            float *w = columns ? AT(after, j, i) : AT(after, i, j);
            for (int64_t b = 0; b < BLOCK; b++) w[b] = v[b] * sum[b];
        }
        for (int64_t b = 0; b < BLOCK; b++) inverse[i * BLOCK + b] = sum[b];
    }
}

/* grad <- (grad - sum(grad * after along the axis)) / sum: the backward of divide_step */
static void divide_step_backward(float *restrict grad, const float *restrict after, const float *restrict inverse,
                                 int64_t n, int columns) {
    for (int64_t i = 0; i < n; i++) {
        const float *inv = inverse + i * BLOCK;
        float inner[BLOCK];
        for (int64_t b = 0; b < BLOCK; b++) inner[b] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *g = columns ? AT(grad, j, i) : AT(grad, i, j);
            const float *a = columns ? AT(after, j, i) : AT(after, i, j);
            for (int64_t b = 0; b < BLOCK; b++) inner[b] += g[b] * a[b];
        }
        for (int64_t j = 0; j < n; j++) {
            float *g = columns ? AT(grad, j, i) : AT(grad, i, j);
            for (int64_t b = 0; b < BLOCK; b++) g[b] = (g[b] - inner[b]) * inv[b];
        }
    }
}

/* grad <- y * (grad - sum(grad * y along the axis)): the backward of softmax_along's y */
static void softmax_backward_along(float *restrict grad, const float *restrict y, int64_t n, int columns) {
    for (int64_t i = 0; i < n; i++) {
        float inner[BLOCK];
        for (int64_t b = 0; b < BLOCK; b++) inner[b] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *g = columns ? AT(grad, j, i) : AT(grad, i, j);
            const float *v = columns ? AT(y, j, i) : AT(y, i, j);
            for (int64_t b = 0; b < BLOCK; b++) inner[b] += g[b] * v[b];
        }
        for (int64_t j = 0; j < n; j++) {
            float *g = columns ? AT(grad, j, i) : AT(grad, i, j);
            const float *v = columns ? AT(y, j, i) : AT(y, i, j);
            for (int64_t b = 0; b < BLOCK; b++) g[b] = v[b] * (g[b] - inner[b]);
        }
    }
}

/* Every iterate of one block: states[0] after the first iteration, then per remaining iteration
 * the matrix after its column step and after its row step; inverses[k]: the reciprocal sums
 * that made states[k] (k >= 1; inverses[0]: the first row step's when eps > 0). p: the column
 * softmax when eps > 0, shifted: p + eps. */
static void sinkhorn_block(const float *logits, float *states, float *inverses, float *p, float *shifted, int64_t n,
                           int64_t iters, float eps) {
    int64_t size = n * n * BLOCK;
    if (eps > 0.0f) {
        softmax_along(logits, p, n, 1);
        for (int64_t k = 0; k < size; k++) shifted[k] = p[k] + eps;
        divide_step(shifted, states, inverses, n, 0, eps);
    } else {
        first_iteration(logits, states, n);
    }
    for (int64_t k = 1; k < 2 * iters - 1; k++)
        divide_step(states + (k - 1) * size, states + k * size, inverses + k * n * BLOCK, n, k % 2, eps);
}

static int64_t block_floats(int64_t n, int64_t iters) {
    /* states, inverses, p, p + eps, logits, grad */
    return (2 * iters - 1) * n * n * BLOCK + (2 * iters - 1) * n * BLOCK + 4 * n * n * BLOCK;
}

/* The threads that share `blocks` blocks of work: as many as OpenMP offers (the team PyTorch's
 * CPU ops use, so torch.set_num_threads applies), one for small inputs. */
static int threads_for(int64_t blocks) { return blocks >= PARALLEL_BLOCKS ? omp_get_max_threads() : 1; }

/* One Sinkhorn block: the logits of tokens [t0, t0 + count) through every iterate, then the
 * output (grad_out NULL) or the gradient w.r.t. the logits (mhc.reference's
 * sinkhorn_exact_backward, with the iterates recomputed instead of rebuilt). */
static void sinkhorn_tokens(const float *logits, const float *grad_out, float *result, float *work, int64_t t0,
                            int64_t count, int64_t n, int64_t iters, float eps) {
    int64_t size = n * n * BLOCK;
    float *states = work, *inverses = states + (2 * iters - 1) * size;
    float *p = inverses + (2 * iters - 1) * n * BLOCK, *shifted = p + size, *block = shifted + size;
    float *grad = block + size;
    load_block(block, logits, t0, count, n);
    sinkhorn_block(block, states, inverses, p, shifted, n, iters, eps);
    if (!grad_out) {
        store_block(result, states + (2 * iters - 2) * size, t0, count, n);
        return;
    }
    load_block(grad, grad_out, t0, count, n);
    for (int64_t k = 2 * iters - 2; k >= 1; k--)
        divide_step_backward(grad, states + k * size, inverses + k * n * BLOCK, n, k % 2);
    if (eps > 0.0f) {
        /* states[0] = (p + eps) / inverses[0] (row step), p the column softmax */
        divide_step_backward(grad, states, inverses, n, 0);
        softmax_backward_along(grad, p, n, 1);
    } else {
        /* states[0] = softmax over columns of z, z = logits - logsumexp over rows */
        softmax_backward_along(grad, states, n, 0);
        softmax_along(block, p, n, 1); /* d logsumexp / d logits */
        for (int64_t c = 0; c < n; c++) {
            float total[BLOCK];
            for (int64_t b = 0; b < BLOCK; b++) total[b] = 0.0f;
            for (int64_t r = 0; r < n; r++)
                for (int64_t b = 0; b < BLOCK; b++) total[b] += AT(grad, r, c)[b];
            for (int64_t r = 0; r < n; r++)
                for (int64_t b = 0; b < BLOCK; b++) AT(grad, r, c)[b] -= AT(p, r, c)[b] * total[b];
        }
    }
    store_block(result, grad, t0, count, n);
}

/* Every block of tokens, split over the threads; each thread works in its own slice of one
 * allocation. Tokens are independent, so the result does not depend on the thread count. */
static int sinkhorn_all(const float *logits, const float *grad_out, float *result, int64_t tokens, int64_t n,
                        int64_t iters, float eps) {
    int64_t blocks = (tokens + BLOCK - 1) / BLOCK, per_thread = block_floats(n, iters);
    int threads = threads_for(blocks);
    float *work = malloc(sizeof(float) * per_thread * threads);
    if (!work) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < blocks; i++) {
        int64_t t0 = i * BLOCK, count = tokens - t0 < BLOCK ? tokens - t0 : BLOCK;
        sinkhorn_tokens(logits, grad_out, result, work + omp_get_thread_num() * per_thread, t0, count, n, iters, eps);
    }
    free(work);
    return 0;
}

int mhc_sinkhorn_forward(const float *logits, float *out, int64_t tokens, int64_t n, int64_t iters, float eps) {
    return sinkhorn_all(logits, NULL, out, tokens, n, iters, eps);
}

/* The gradient of mhc_sinkhorn_forward's output w.r.t. the logits. */
int mhc_sinkhorn_backward(const float *logits, const float *grad_out, float *grad_logits, int64_t tokens, int64_t n,
                          int64_t iters, float eps) {
    return sinkhorn_all(logits, grad_out, grad_logits, tokens, n, iters, eps);
}

/* The threads for a mix over `tokens` tokens of n streams of width d. */
static int mix_threads(int64_t tokens, int64_t n, int64_t d) {
    return tokens * n * d >= PARALLEL_FLOATS ? omp_get_max_threads() : 1;
}

/* pre-mix: out[t, k] = sum_s h[t, s] x[t, s, k]; x [T, n, d], h [T, n], out [T, d] */
void mhc_pre_mix_forward(const float *restrict x, const float *restrict h, float *restrict out, int64_t tokens,
                         int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *xt = x + t * n * d, *ht = h + t * n;
        float *o = out + t * d;
        for (int64_t k = 0; k < d; k++) o[k] = ht[0] * xt[k];
        for (int64_t s = 1; s < n; s++)
            for (int64_t k = 0; k < d; k++) o[k] += ht[s] * xt[s * d + k];
    }
}

/* grad_x[t, s, k] = h[t, s] g[t, k]; grad_h[t, s] = sum_k g[t, k] x[t, s, k] */
void mhc_pre_mix_backward(const float *restrict x, const float *restrict h, const float *restrict g,
                          float *restrict grad_x, float *restrict grad_h, int64_t tokens, int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *xt = x + t * n * d, *ht = h + t * n, *gt = g + t * d;
        for (int64_t s = 0; s < n; s++) {
            for (int64_t k = 0; k < d; k++) grad_x[(t * n + s) * d + k] = ht[s] * gt[k];
            grad_h[t * n + s] = dot(gt, xt + s * d, d);
        }
    }
}

/* post-mix: out[t, i, k] = sum_j h_res[t, i, j] x[t, j, k] + h_post[t, i] y[t, k] */
void mhc_post_mix_forward(const float *restrict x, const float *restrict h_res, const float *restrict y,
                          const float *restrict h_post, float *restrict out, int64_t tokens, int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *xt = x + t * n * d, *hr = h_res + t * n * n, *yt = y + t * d;
        for (int64_t i = 0; i < n; i++) {
            float *o = out + (t * n + i) * d;
            for (int64_t k = 0; k < d; k++) o[k] = hr[i * n] * xt[k];
            for (int64_t j = 1; j < n; j++)
                for (int64_t k = 0; k < d; k++) o[k] += hr[i * n + j] * xt[j * d + k];
            for (int64_t k = 0; k < d; k++) o[k] += h_post[t * n + i] * yt[k];
        }
    }
}

/* grad_x[t, j] = sum_i h_res[t, i, j] g[t, i]; grad_h_res[t, i, j] = <g[t, i], x[t, j]>;
 * grad_y[t] = sum_i h_post[t, i] g[t, i]; grad_h_post[t, i] = <g[t, i], y[t]> */
void mhc_post_mix_backward(const float *restrict x, const float *restrict h_res, const float *restrict y,
                           const float *restrict h_post, const float *restrict g, float *restrict grad_x,
                           float *restrict grad_h_res, float *restrict grad_y, float *restrict grad_h_post,
                           int64_t tokens, int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *xt = x + t * n * d, *hr = h_res + t * n * n, *yt = y + t * d, *gt = g + t * n * d;
        float *gx = grad_x + t * n * d, *gy = grad_y + t * d;
        for (int64_t j = 0; j < n; j++) {
            for (int64_t k = 0; k < d; k++) gx[j * d + k] = hr[j] * gt[k];
            for (int64_t i = 1; i < n; i++)
                for (int64_t k = 0; k < d; k++) gx[j * d + k] += hr[i * n + j] * gt[i * d + k];
        }
        for (int64_t k = 0; k < d; k++) gy[k] = h_post[t * n] * gt[k];
        for (int64_t i = 1; i < n; i++)
            for (int64_t k = 0; k < d; k++) gy[k] += h_post[t * n + i] * gt[i * d + k];
        for (int64_t i = 0; i < n; i++) {
            grad_h_post[t * n + i] = dot(gt + i * d, yt, d);
            for (int64_t j = 0; j < n; j++) grad_h_res[(t * n + i) * n + j] = dot(gt + i * d, xt + j * d, d);
        }
    }
}
