/* Decode attention over a paged key/value cache, float32 on CPU: the compiled CPU serving path.

   The torch reference gathers every used cache block into one batch before it multiplies, so each
   step copies the whole context once more than it reads it. This kernel reads the blocks where
   they lie: one work item is one (sequence, kv head) pair, whose query heads share every key and
   value it loads, with an online softmax across blocks. Inputs are checked by the Python wrapper
   (shapes, dtypes, table entries, lengths); nothing here allocates on the heap.

   Layouts (all contiguous, row-major):
     q            (num_seqs, heads, head_dim)
     k_cache      (num_blocks, kv_heads, block_size, head_dim), v_cache the same
     block_table  (num_seqs, max_blocks) int32
     context_lens (num_seqs,) int32
     out          (num_seqs, heads, head_dim)
   window 0 means no sliding window. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 64    /* query heads per kv head; the wrapper sends larger groups to torch */
#define MAX_HEAD_DIM 128
#define MAX_BLOCK 256   /* block_size; likewise */

typedef struct {
    const float *q;
    const float *k_cache;
    const float *v_cache;
    const int32_t *block_table;
    const int32_t *context_lens;
    float *out;
    int64_t num_seqs, heads, kv_heads, head_dim, block_size, max_blocks, window;
    float scale;
} Job;

/* exp(x) for x <= 0 (every weight is exp(score - peak)), as 2^n * e^r with |r| <= ln2/2 and a
   degree-6 polynomial for e^r: relative error under 2e-7, and, unlike libm's expf, plain arithmetic
   that the compiler vectorizes. Below -87 (and at -inf) it is 0. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(clamped * 1.44269504088896341f);
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* Inlined into one copy per head_dim, so the compiler sees the vector loops' trip counts. */
static inline __attribute__((always_inline)) void attend(const Job *job, int64_t seq, int64_t kv_head,
                                                         const int64_t dim) {
    const int64_t block = job->block_size;
    const int64_t group = job->heads / job->kv_heads;
    const float *query = job->q + (seq * job->heads + kv_head * group) * dim;
    float *out = job->out + (seq * job->heads + kv_head * group) * dim;
    const int64_t length = job->context_lens[seq];
    const int64_t lowest = (job->window > 0 && length > job->window) ? length - job->window : 0;

    float peak[MAX_GROUP], total[MAX_GROUP];
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    float scores[MAX_GROUP * MAX_BLOCK];
    for (int64_t g = 0; g < group; ++g) {
        peak[g] = -INFINITY;
        total[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(group * dim));

    const int32_t *table = job->block_table + seq * job->max_blocks;
    for (int64_t b = lowest / block; b * block < length; ++b) {
        const int64_t base = ((int64_t)table[b] * job->kv_heads + kv_head) * block * dim;
        const float *keys = job->k_cache + base;
        const float *values = job->v_cache + base;
        if ((b + 1) * block < length) {
            /* The cache blocks lie anywhere in memory, so the hardware cannot guess the next one:
               ask for it while this one is computed. */
            const int64_t next = ((int64_t)table[b + 1] * job->kv_heads + kv_head) * block * dim;
            for (int64_t line = 0; line < block * dim; line += 16) {
                __builtin_prefetch(job->k_cache + next + line, 0, 3);
                __builtin_prefetch(job->v_cache + next + line, 0, 3);
            }
        }
        const int64_t lo = lowest > b * block ? lowest - b * block : 0;
        const int64_t hi = length - b * block < block ? length - b * block : block;

        for (int64_t t = lo; t < hi; ++t) {
            const float *key = keys + t * dim;
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = query + g * dim;
                float dot = 0.0f;
                for (int64_t d = 0; d < dim; ++d) dot += qg[d] * key[d];
                scores[g * block + t] = dot * job->scale;
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            float *sg = scores + g * block;
            float block_peak = sg[lo];
            for (int64_t t = lo + 1; t < hi; ++t) block_peak = sg[t] > block_peak ? sg[t] : block_peak;
            const float new_peak = block_peak > peak[g] ? block_peak : peak[g];
            /* The first block has nothing to rescale; exp(-inf) would be 0 anyway, but say so. */
            const float rescale = peak[g] == -INFINITY ? 0.0f : exp_nonpositive(peak[g] - new_peak);
            float *ag = acc + g * dim;
            if (rescale != 1.0f) {
                total[g] *= rescale;
                for (int64_t d = 0; d < dim; ++d) ag[d] *= rescale;
            }
            float block_total = 0.0f;
            for (int64_t t = lo; t < hi; ++t) {
                sg[t] = exp_nonpositive(sg[t] - new_peak);
                block_total += sg[t];
            }
            total[g] += block_total;
            for (int64_t t = lo; t < hi; ++t) {
                const float weight = sg[t];
                const float *value = values + t * dim;
                for (int64_t d = 0; d < dim; ++d) ag[d] += weight * value[d];
            }
            peak[g] = new_peak;
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float *og = out + g * dim;
        const float *ag = acc + g * dim;
        if (total[g] > 0.0f) {
            const float inverse = 1.0f / total[g];
            for (int64_t d = 0; d < dim; ++d) og[d] = ag[d] * inverse;
        } else { /* context 0: no keys, zeros as the reference gives */
            memset(og, 0, sizeof(float) * (size_t)dim);
        }
    }
}

static void attend_one(const Job *job, int64_t seq, int64_t kv_head) {
    switch (job->head_dim) {
        case 16: attend(job, seq, kv_head, 16); break;
        case 32: attend(job, seq, kv_head, 32); break;
        case 64: attend(job, seq, kv_head, 64); break;
        case 128: attend(job, seq, kv_head, 128); break;
        default: attend(job, seq, kv_head, job->head_dim);
    }
}

/* Work items go to OpenMP threads. torch is loaded first and its libgomp has the same soname, so
   this library joins torch's thread pool instead of starting a second one that would fight it. */
void ipnext_paged_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int32_t *block_table, const int32_t *context_lens, float *out,
                                int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t max_blocks, int64_t window, float scale,
                                int64_t threads) {
    const Job job = {q, k_cache, v_cache, block_table, context_lens, out, num_seqs, heads, kv_heads,
                     head_dim, block_size, max_blocks, window, scale};
    const int64_t items = num_seqs * kv_heads;
    if (threads < 1 || items < 2) threads = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; ++item) attend_one(&job, item / kv_heads, item % kv_heads);
}
