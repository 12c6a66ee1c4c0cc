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
    /* states, inverses, p, p + eps, logits, grad; a site's coefficients and their gradients */
    return (2 * iters - 1) * n * n * BLOCK + (2 * iters - 1) * n * BLOCK + 4 * n * n * BLOCK +
           2 * (2 * n + n * n) * BLOCK;
}

/* The threads that share `blocks` blocks of work: as many as OpenMP offers (the team PyTorch's
 * CPU ops use, so torch.set_num_threads applies) up to one per block, one for small inputs; each
 * gets its own working memory. */
static int threads_for(int64_t blocks) {
    int64_t most = omp_get_max_threads();
    return blocks < PARALLEL_BLOCKS ? 1 : (int)(blocks < most ? blocks : most);
}

/* One thread's working memory for a block (block_floats(n, iters) floats), all in block layout:
 * Sinkhorn's logits and gradient and what sinkhorn_block keeps; a site's 2n + n n coefficients
 * per token and their gradients. */
typedef struct {
    float *states, *inverses, *p, *shifted, *logits, *grad, *coefficients, *coefficient_grads;
} Work;

static Work work_at(float *memory, int64_t n, int64_t iters) {
    int64_t size = n * n * BLOCK;
    Work w;
    w.states = memory;
    w.inverses = w.states + (2 * iters - 1) * size;
    w.p = w.inverses + (2 * iters - 1) * n * BLOCK;
    w.shifted = w.p + size;
    w.logits = w.shifted + size;
    w.grad = w.logits + size;
    w.coefficients = w.grad + size;
    w.coefficient_grads = w.coefficients + (2 * n + n * n) * BLOCK;
    return w;
}

/* n = 4 (the paper's) as a constant: the compiler unrolls the loops over rows and columns */
static void sinkhorn_work(Work w, int64_t n, int64_t iters, float eps) {
    if (n == 4)
        sinkhorn_block(w.logits, w.states, w.inverses, w.p, w.shifted, 4, iters, eps);
    else
        sinkhorn_block(w.logits, w.states, w.inverses, w.p, w.shifted, n, iters, eps);
}

static const float *sinkhorn_result(Work w, int64_t n, int64_t iters) { return w.states + (2 * iters - 2) * n * n * BLOCK; }

/* w.grad, the gradient w.r.t. the output of sinkhorn_work's w.logits, becomes the gradient
 * w.r.t. the logits (mhc.reference's sinkhorn_exact_backward, the iterates recomputed instead of
 * rebuilt); sinkhorn_work has run on w. */
static void sinkhorn_work_backward_n(Work w, int64_t n, int64_t iters, float eps);
static void sinkhorn_work_backward(Work w, int64_t n, int64_t iters, float eps) { /* as sinkhorn_work */
    if (n == 4)
        sinkhorn_work_backward_n(w, 4, iters, eps);
    else
        sinkhorn_work_backward_n(w, n, iters, eps);
}

static void sinkhorn_work_backward_n(Work w, int64_t n, int64_t iters, float eps) {
    int64_t size = n * n * BLOCK;
    float *grad = w.grad;
    for (int64_t k = 2 * iters - 2; k >= 1; k--)
        divide_step_backward(grad, w.states + k * size, w.inverses + k * n * BLOCK, n, k % 2);
    if (eps > 0.0f) {
        /* states[0] = (p + eps) / inverses[0] (row step), p the column softmax */
        divide_step_backward(grad, w.states, w.inverses, n, 0);
        softmax_backward_along(grad, w.p, n, 1);
    } else {
        /* states[0] = softmax over columns of z, z = logits - logsumexp over rows */
        softmax_backward_along(grad, w.states, n, 0);
        softmax_along(w.logits, w.p, n, 1); /* d logsumexp / d logits */
        for (int64_t c = 0; c < n; c++) {
            float total[BLOCK];
            for (int64_t b = 0; b < BLOCK; b++) total[b] = 0.0f;
            for (int64_t r = 0; r < n; r++)
                for (int64_t b = 0; b < BLOCK; b++) total[b] += AT(grad, r, c)[b];
            for (int64_t r = 0; r < n; r++)
                for (int64_t b = 0; b < BLOCK; b++) AT(grad, r, c)[b] -= AT(w.p, r, c)[b] * total[b];
        }
    }
}

typedef void (*BlockTask)(const void *args, Work w, int64_t t0, int64_t count);

/* task(args, w, t0, count) for every block of BLOCK tokens, the blocks split over the threads;
 * each thread works in its own slice of one allocation. Tokens are independent, so the result
 * does not depend on the thread count. Returns 1 when the working memory cannot be allocated. */
static int for_each_block(BlockTask task, const void *args, int64_t tokens, int64_t n, int64_t iters) {
    int64_t blocks = (tokens + BLOCK - 1) / BLOCK, per_thread = block_floats(n, iters);
    int threads = threads_for(blocks);
    float *memory = malloc(sizeof(float) * per_thread * threads);
    if (!memory) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < blocks; i++) {
        int64_t t0 = i * BLOCK, count = tokens - t0 < BLOCK ? tokens - t0 : BLOCK;
        task(args, work_at(memory + omp_get_thread_num() * per_thread, n, iters), t0, count);
    }
    free(memory);
    return 0;
}

typedef struct {
    const float *logits, *grad_out; /* grad_out NULL: the forward */
    float *result;
    int64_t n, iters;
    float eps;
} SinkhornArgs;

/* Tokens [t0, t0 + count) of the logits through Sinkhorn: the output, or the gradient w.r.t.
 * the logits. */
static void sinkhorn_tokens(const void *task_args, Work w, int64_t t0, int64_t count) {
    const SinkhornArgs *a = task_args;
    int64_t n = a->n, iters = a->iters;
    load_block(w.logits, a->logits, t0, count, n);
    sinkhorn_work(w, n, iters, a->eps);
    if (!a->grad_out) {
        store_block(a->result, sinkhorn_result(w, n, iters), t0, count, n);
        return;
    }
    load_block(w.grad, a->grad_out, t0, count, n);
    sinkhorn_work_backward(w, n, iters, a->eps);
    store_block(a->result, w.grad, t0, count, n);
}

int mhc_sinkhorn_forward(const float *logits, float *out, int64_t tokens, int64_t n, int64_t iters, float eps) {
    SinkhornArgs args = {logits, NULL, out, n, iters, eps};
    return for_each_block(sinkhorn_tokens, &args, tokens, n, iters);
}

/* The gradient of mhc_sinkhorn_forward's output w.r.t. the logits. */
int mhc_sinkhorn_backward(const float *logits, const float *grad_out, float *grad_logits, int64_t tokens, int64_t n,
                          int64_t iters, float eps) {
    SinkhornArgs args = {logits, grad_out, grad_logits, n, iters, eps};
    return for_each_block(sinkhorn_tokens, &args, tokens, n, iters);
}

/* The threads for a mix over `tokens` tokens of n streams of width d. */
static int mix_threads(int64_t tokens, int64_t n, int64_t d) {
    return tokens * n * d >= PARALLEL_FLOATS ? omp_get_max_threads() : 1;
}

/* The mixes below run one function per token (restrict pointers, so that its loops vectorise
 * as they would outside the OpenMP region) over the tokens split between the threads. */

/* pre-mix: out[t, k] = sum_s h[t, s] x[t, s, k]; x [T, n, d], h [T, n], out [T, d] */
static void pre_mix_token(const float *restrict xt, const float *restrict ht, float *restrict o, int64_t n,
                          int64_t d) {
    for (int64_t k = 0; k < d; k++) o[k] = ht[0] * xt[k];
    for (int64_t s = 1; s < n; s++)
        for (int64_t k = 0; k < d; k++) o[k] += ht[s] * xt[s * d + k];
}

void mhc_pre_mix_forward(const float *x, const float *h, float *out, int64_t tokens, int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++) pre_mix_token(x + t * n * d, h + t * n, out + t * d, n, d);
}

/* grad_x[t, s, k] = h[t, s] g[t, k]; grad_h[t, s] = sum_k g[t, k] x[t, s, k] */
static void pre_mix_backward_token(const float *restrict xt, const float *restrict ht, const float *restrict gt,
                                   float *restrict gx, float *restrict gh, int64_t n, int64_t d) {
    for (int64_t s = 0; s < n; s++) {
        for (int64_t k = 0; k < d; k++) gx[s * d + k] = ht[s] * gt[k];
        gh[s] = dot(gt, xt + s * d, d);
    }
}

void mhc_pre_mix_backward(const float *x, const float *h, const float *g, float *grad_x, float *grad_h,
                          int64_t tokens, int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        pre_mix_backward_token(x + t * n * d, h + t * n, g + t * d, grad_x + t * n * d, grad_h + t * n, n, d);
}

/* post-mix: out[t, i, k] = sum_j h_res[t, i, j] x[t, j, k] + h_post[t, i] y[t, k] */
static void post_mix_token(const float *restrict xt, const float *restrict hr, const float *restrict yt,
                           const float *restrict hp, float *restrict out, int64_t n, int64_t d) {
    for (int64_t i = 0; i < n; i++) {
        float *o = out + i * d;
        for (int64_t k = 0; k < d; k++) o[k] = hr[i * n] * xt[k];
        for (int64_t j = 1; j < n; j++)
            for (int64_t k = 0; k < d; k++) o[k] += hr[i * n + j] * xt[j * d + k];
        for (int64_t k = 0; k < d; k++) o[k] += hp[i] * yt[k];
    }
}

void mhc_post_mix_forward(const float *x, const float *h_res, const float *y, const float *h_post, float *out,
                          int64_t tokens, int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        post_mix_token(x + t * n * d, h_res + t * n * n, y + t * d, h_post + t * n, out + t * n * d, n, d);
}

/* grad_x[t, j] = sum_i h_res[t, i, j] g[t, i]; grad_h_res[t, i, j] = <g[t, i], x[t, j]>;
 * grad_y[t] = sum_i h_post[t, i] g[t, i]; grad_h_post[t, i] = <g[t, i], y[t]> */
static void post_mix_backward_token(const float *restrict xt, const float *restrict hr, const float *restrict yt,
                                    const float *restrict hp, const float *restrict gt, float *restrict gx,
                                    float *restrict ghr, float *restrict gy, float *restrict ghp, int64_t n,
                                    int64_t d) {
    for (int64_t j = 0; j < n; j++) {
        for (int64_t k = 0; k < d; k++) gx[j * d + k] = hr[j] * gt[k];
        for (int64_t i = 1; i < n; i++)
            for (int64_t k = 0; k < d; k++) gx[j * d + k] += hr[i * n + j] * gt[i * d + k];
    }
    for (int64_t k = 0; k < d; k++) gy[k] = hp[0] * gt[k];
    for (int64_t i = 1; i < n; i++)
        for (int64_t k = 0; k < d; k++) gy[k] += hp[i] * gt[i * d + k];
    for (int64_t i = 0; i < n; i++) {
        ghp[i] = dot(gt + i * d, yt, d);
        for (int64_t j = 0; j < n; j++) ghr[i * n + j] = dot(gt + i * d, xt + j * d, d);
    }
}

void mhc_post_mix_backward(const float *x, const float *h_res, const float *y, const float *h_post, const float *g,
                           float *grad_x, float *grad_h_res, float *grad_y, float *grad_h_post, int64_t tokens,
                           int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        post_mix_backward_token(x + t * n * d, h_res + t * n * n, y + t * d, h_post + t * n, g + t * n * d,
                                grad_x + t * n * d, grad_h_res + t * n * n, grad_y + t * d, grad_h_post + t * n, n,
                                d);
}

/* ---------------------------------------------------------------- a dynamic mHC site's start
 *
 * The coefficients from the projection and the pre-mix (mhc.coefficients.DynamicMHC.reference
 * and the pre-mix). Per token t, with K = n d, M = 2n + n n, v = x[t] flattened and
 * proj[t] = v @ phi (computed outside, by a matmul):
 *   inv = 1 / sqrt(sum(v^2) / K + rms_eps), z = proj[t] * inv,
 *   h_pre = sigmoid(b_pre + a_pre z_pre) + hc_eps, h_post = 2 sigmoid(b_post + a_post z_post),
 *   h_res = Sinkhorn(b_res + a_res z_res), x_in = sum_s h_pre[s] x[t, s]. */

/* sigmoid(x) from exp(-|x|), which keeps exp's argument <= 0; NaN stays NaN */
static inline float sigmoid(float x) {
    float e = exp_nonpositive(x > 0.0f ? -x : x);
    return x > 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

typedef struct {
    const float *x, *proj, *alpha, *bias; /* x [T, n, d], proj [T, M], alpha [3], bias [M] */
    const float *inv_rms;                 /* backward: [T], as the forward wrote it */
    const float *grad_x_in, *grad_h_post, *grad_h_res; /* backward, each NULL for a zero gradient */
    float *x_in, *h_pre, *h_post, *h_res, *inv_rms_out; /* forward */
    float *grad_bias, *grad_gates, *grad_proj, *rms_coef; /* backward: [T, M], [T, 3], [T, M], [T] */
    int64_t n, d, iters;
    float rms_eps, hc_eps;
} SiteStartArgs;

/* Per token of the block: inv[b] = 1 / RMS(x[t]) (the forward computes it, the backward reads
 * it), and z = proj * inv into w.coefficients ([M][BLOCK]); past the last token, zeros. */
static void normalized_coefficients(const SiteStartArgs *a, Work w, int64_t t0, int64_t count, float *inv) {
    int64_t n = a->n, K = n * a->d, M = 2 * n + n * n;
    for (int64_t b = 0; b < BLOCK; b++) {
        int64_t t = t0 + b;
        if (b >= count)
            inv[b] = 0.0f;
        else if (a->inv_rms)
            inv[b] = a->inv_rms[t];
        else
            inv[b] = a->inv_rms_out[t] = 1.0f / sqrtf(dot(a->x + t * K, a->x + t * K, K) / (float)K + a->rms_eps);
        for (int64_t m = 0; m < M; m++) w.coefficients[m * BLOCK + b] = b < count ? a->proj[t * M + m] * inv[b] : 0.0f;
    }
}

/* w.logits = b_res + a_res z_res, Sinkhorn's input */
static void residual_logits(const SiteStartArgs *a, Work w) {
    int64_t n = a->n;
    for (int64_t k = 0; k < n * n; k++)
        for (int64_t b = 0; b < BLOCK; b++)
            w.logits[k * BLOCK + b] = a->bias[2 * n + k] + a->alpha[2] * w.coefficients[(2 * n + k) * BLOCK + b];
}

/* out[b] = scale * sigmoid(bias + gate z[b]) + shift over a block */
static void sigmoid_block(const float *z, float bias, float gate, float scale, float shift, float *out) {
    for (int64_t b = 0; b < BLOCK; b++) out[b] = scale * sigmoid(bias + gate * z[b]) + shift;
}

static void site_start_tokens(const void *task_args, Work w, int64_t t0, int64_t count) {
    const SiteStartArgs *a = task_args;
    int64_t n = a->n, d = a->d, K = n * d;
    float inv[BLOCK], h[BLOCK];
    normalized_coefficients(a, w, t0, count, inv);
    for (int64_t s = 0; s < 2 * n; s++) { /* h_pre, then h_post */
        int pre = s < n;
        sigmoid_block(w.coefficients + s * BLOCK, a->bias[s], a->alpha[pre ? 0 : 1], pre ? 1.0f : 2.0f,
                      pre ? a->hc_eps : 0.0f, h);
        float *out = pre ? a->h_pre + s : a->h_post + (s - n);
        for (int64_t b = 0; b < count; b++) out[(t0 + b) * n] = h[b];
    }
    residual_logits(a, w);
    sinkhorn_work(w, n, a->iters, a->hc_eps);
    store_block(a->h_res, sinkhorn_result(w, n, a->iters), t0, count, n);
    for (int64_t t = t0; t < t0 + count; t++) pre_mix_token(a->x + t * K, a->h_pre + t * n, a->x_in + t * d, n, d);
}

/* x [T, n, d], proj [T, M], alpha [3], bias [M] -> x_in [T, d], h_pre [T, n], h_post [T, n],
 * h_res [T, n, n] and inv_rms [T] (for the backward) */
int mhc_site_start_forward(const float *x, const float *proj, const float *alpha, const float *bias, float *x_in,
                           float *h_pre, float *h_post, float *h_res, float *inv_rms, int64_t tokens, int64_t n,
                           int64_t d, int64_t iters, float rms_eps, float hc_eps) {
    SiteStartArgs args = {0};
    args.x = x, args.proj = proj, args.alpha = alpha, args.bias = bias;
    args.x_in = x_in, args.h_pre = h_pre, args.h_post = h_post, args.h_res = h_res, args.inv_rms_out = inv_rms;
    args.n = n, args.d = d, args.iters = iters, args.rms_eps = rms_eps, args.hc_eps = hc_eps;
    return for_each_block(site_start_tokens, &args, tokens, n, iters);
}

static void site_start_backward_tokens(const void *task_args, Work w, int64_t t0, int64_t count) {
    const SiteStartArgs *a = task_args;
    int64_t n = a->n, d = a->d, nn = n * n, K = n * d, M = 2 * n + nn;
    float inv[BLOCK], y[BLOCK], *z = w.coefficients, *dl = w.coefficient_grads;
    normalized_coefficients(a, w, t0, count, inv);
    /* the gradients w.r.t. h_pre (<grad_x_in, x[s]>) and h_post, in block layout */
    for (int64_t b = 0; b < BLOCK; b++) {
        int64_t t = t0 + b;
        for (int64_t s = 0; s < n; s++) {
            int real = b < count;
            dl[s * BLOCK + b] = real && a->grad_x_in ? dot(a->grad_x_in + t * d, a->x + t * K + s * d, d) : 0.0f;
            dl[(n + s) * BLOCK + b] = real && a->grad_h_post ? 2.0f * a->grad_h_post[t * n + s] : 0.0f;
        }
    }
    /* through the sigmoids: h_pre = sigmoid(.) + hc_eps, h_post = 2 sigmoid(.) */
    for (int64_t s = 0; s < 2 * n; s++) {
        sigmoid_block(z + s * BLOCK, a->bias[s], a->alpha[s < n ? 0 : 1], 1.0f, 0.0f, y);
        for (int64_t b = 0; b < BLOCK; b++) dl[s * BLOCK + b] *= (1.0f - y[b]) * y[b];
    }
    /* through Sinkhorn */
    if (a->grad_h_res) {
        residual_logits(a, w);
        load_block(w.grad, a->grad_h_res, t0, count, n);
        sinkhorn_work(w, n, a->iters, a->hc_eps);
        sinkhorn_work_backward(w, n, a->iters, a->hc_eps);
    }
    for (int64_t k = 0; k < nn; k++)
        for (int64_t b = 0; b < BLOCK; b++) dl[(2 * n + k) * BLOCK + b] = a->grad_h_res ? w.grad[k * BLOCK + b] : 0.0f;
    /* per token: the gates' gradients, and <grad z, z> for the norm's */
    float gates[3][BLOCK], inner[BLOCK];
    for (int64_t b = 0; b < BLOCK; b++) gates[0][b] = gates[1][b] = gates[2][b] = inner[b] = 0.0f;
    for (int64_t m = 0; m < M; m++) {
        int gate = m < n ? 0 : m < 2 * n ? 1 : 2;
        float alpha = a->alpha[gate];
        for (int64_t b = 0; b < BLOCK; b++) {
            float g = dl[m * BLOCK + b], gz = alpha * g;
            gates[gate][b] += g * z[m * BLOCK + b];
            inner[b] += gz * z[m * BLOCK + b];
            z[m * BLOCK + b] = gz * inv[b]; /* now the gradient w.r.t. proj */
        }
    }
    for (int64_t b = 0; b < count; b++) {
        int64_t t = t0 + b;
        for (int64_t m = 0; m < M; m++) {
            a->grad_bias[t * M + m] = dl[m * BLOCK + b];
            a->grad_proj[t * M + m] = z[m * BLOCK + b];
        }
        for (int64_t i = 0; i < 3; i++) a->grad_gates[t * 3 + i] = gates[i][b];
        /* d inv / d v = -inv^3 v / K, and <grad z, proj> = <grad z, z> / inv */
        a->rms_coef[t] = -inner[b] * (inv[b] * inv[b]) / (float)K;
    }
}

/* The backward of mhc_site_start_forward, up to the matmuls: from grad_x_in [T, d],
 * grad_h_post [T, n] and grad_h_res [T, n, n] (each NULL for a zero gradient), per token the
 * gradients w.r.t. the biased logits (= the bias's, [T, M]), the gates' ([T, 3]), the
 * projection's (proj, before the norm: [T, M]) and the factor of x in the norm's gradient
 * (rms_coef [T]). mhc_site_start_grad_x assembles x's gradient after grad_proj @ phi^T. */
int mhc_site_start_backward(const float *x, const float *proj, const float *alpha, const float *bias,
                            const float *inv_rms, const float *grad_x_in, const float *grad_h_post,
                            const float *grad_h_res, float *grad_bias, float *grad_gates, float *grad_proj,
                            float *rms_coef, int64_t tokens, int64_t n, int64_t d, int64_t iters, float hc_eps) {
    SiteStartArgs args = {0};
    args.x = x, args.proj = proj, args.alpha = alpha, args.bias = bias, args.inv_rms = inv_rms;
    args.grad_x_in = grad_x_in, args.grad_h_post = grad_h_post, args.grad_h_res = grad_h_res;
    args.grad_bias = grad_bias, args.grad_gates = grad_gates, args.grad_proj = grad_proj, args.rms_coef = rms_coef;
    args.n = n, args.d = d, args.iters = iters, args.hc_eps = hc_eps;
    return for_each_block(site_start_backward_tokens, &args, tokens, n, iters);
}

/* grad_x [T, n, d] (in: grad_proj @ phi^T) += rms_coef[t] x[t, s] + h_pre[t, s] grad_x_in[t]
 * (grad_x_in NULL: zero) */
static void site_start_grad_x_token(float *restrict g, const float *restrict xt, const float *restrict ht,
                                    const float *restrict gin, float c, int64_t n, int64_t d) {
    for (int64_t s = 0; s < n; s++) {
        for (int64_t k = 0; k < d; k++) g[s * d + k] += c * xt[s * d + k];
        if (gin)
            for (int64_t k = 0; k < d; k++) g[s * d + k] += ht[s] * gin[k];
    }
}

void mhc_site_start_grad_x(float *grad_x, const float *x, const float *h_pre, const float *grad_x_in,
                           const float *rms_coef, int64_t tokens, int64_t n, int64_t d) {
#pragma omp parallel for num_threads(mix_threads(tokens, n, d)) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        site_start_grad_x_token(grad_x + t * n * d, x + t * n * d, h_pre + t * n,
                                grad_x_in ? grad_x_in + t * d : NULL, rms_coef[t], n, d);
}
