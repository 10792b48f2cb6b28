/* shmcache/_gather.h: the KV read's one copy, shared by shmcache._gather (C)
 * and shmcache._mlxbuf (C++). No Python here: callers check, then copy with
 * the GIL released.
 *
 * gather_copy(dst, src, ids, n, src_offs, dst_offs, m, chunk, threads) copies,
 * for every j < m and every i < n, the `chunk` bytes at
 * src + src_offs[j] + ids[i]*chunk to dst + dst_offs[j] + i*chunk, split over
 * `threads` threads (the caller's plus threads-1 new).
 *
 * gather_check(...) returns NULL when every such copy stays inside both
 * buffers, else a message naming what is out of bounds (written into msg).
 *
 * NOTE: why not numpy's take: a 2-4 KiB chunk is too short for the hardware
 * prefetcher to ramp up on, and take copies chunk by chunk in one thread. We
 * prefetch the chunk PF_AHEAD places ahead, copy with 32-byte loads and stores
 * where the CPU has them, and split large reads over two threads.
 */
#ifndef SHMCACHE_GATHER_H
#define SHMCACHE_GATHER_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GATHER_MAX_THREADS 8
#define PF_AHEAD 2

typedef struct {
    char *dst;
    const char *src;
    const int64_t *ids, *src_offs, *dst_offs;
    int64_t n, chunk, begin, end;   /* tasks [begin, end) of m*n */
    int wide;
} GatherJob;

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void
gather_copy_wide(char *d, const char *s, int64_t c)
{
    for (int64_t b = 0; b < c; b += 128) {
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(s + b));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(s + b + 32));
        __m256i a2 = _mm256_loadu_si256((const __m256i *)(s + b + 64));
        __m256i a3 = _mm256_loadu_si256((const __m256i *)(s + b + 96));
        _mm256_storeu_si256((__m256i *)(d + b), a0);
        _mm256_storeu_si256((__m256i *)(d + b + 32), a1);
        _mm256_storeu_si256((__m256i *)(d + b + 64), a2);
        _mm256_storeu_si256((__m256i *)(d + b + 96), a3);
    }
}
#endif

static inline const char *
gather_src_of(const GatherJob *j, int64_t t)
{
    return j->src + j->src_offs[t / j->n] + j->ids[t % j->n] * j->chunk;
}

static void
gather_run(const GatherJob *j)
{
    for (int64_t t = j->begin; t < j->end; t++) {
        if (t + PF_AHEAD < j->end) {
            const char *p = gather_src_of(j, t + PF_AHEAD);
            for (int64_t b = 0; b < j->chunk; b += 64)
                __builtin_prefetch(p + b, 0, 3);
        }
        char *d = j->dst + j->dst_offs[t / j->n] + (t % j->n) * j->chunk;
#if defined(__x86_64__)
        if (j->wide) {
            gather_copy_wide(d, gather_src_of(j, t), j->chunk);
            continue;
        }
#endif
        memcpy(d, gather_src_of(j, t), (size_t)j->chunk);
    }
}

static void *
gather_run_thread(void *arg)
{
    gather_run((const GatherJob *)arg);
    return NULL;
}

static const char *
gather_check(int64_t dst_len, int64_t src_len, const int64_t *id, int64_t n,
             const int64_t *s, const int64_t *d, int64_t m, int64_t chunk,
             char *msg, size_t msglen)
{
    int64_t lo = INT64_MAX, hi = -1;
    if (chunk <= 0) {
        snprintf(msg, msglen, "chunk must be positive, got %lld", (long long)chunk);
        return msg;
    }
    for (int64_t i = 0; i < n; i++) {
        lo = id[i] < lo ? id[i] : lo;
        hi = id[i] > hi ? id[i] : hi;
    }
    if (n && lo < 0) {
        snprintf(msg, msglen, "negative id %lld", (long long)lo);
        return msg;
    }
    for (int64_t j = 0; j < m; j++) {
        int64_t end;
        if (s[j] < 0 || (n && (__builtin_mul_overflow(hi + 1, chunk, &end) ||
                               __builtin_add_overflow(end, s[j], &end) || end > src_len))) {
            snprintf(msg, msglen, "src_offsets[%lld]=%lld with id %lld reads past the "
                     "source (%lld bytes)", (long long)j, (long long)s[j], (long long)hi,
                     (long long)src_len);
            return msg;
        }
        if (d[j] < 0 || __builtin_mul_overflow(n, chunk, &end) ||
            __builtin_add_overflow(end, d[j], &end) || end > dst_len) {
            snprintf(msg, msglen, "dst_offsets[%lld]=%lld with %lld chunks writes past the "
                     "destination (%lld bytes)", (long long)j, (long long)d[j], (long long)n,
                     (long long)dst_len);
            return msg;
        }
    }
    return NULL;
}

static void
gather_copy(char *dst, const char *src, const int64_t *ids, int64_t n, const int64_t *so,
            const int64_t *dof, int64_t m, int64_t chunk, int threads)
{
    int64_t total = n * m;
    threads = threads < 1 ? 1 : threads > GATHER_MAX_THREADS ? GATHER_MAX_THREADS : threads;
    if (threads > total)
        threads = total > 0 ? (int)total : 1;
    int wide = 0;
#if defined(__x86_64__)
    wide = chunk % 128 == 0 && __builtin_cpu_supports("avx2");
#endif
    GatherJob jobs[GATHER_MAX_THREADS];
    pthread_t tid[GATHER_MAX_THREADS];
    int started[GATHER_MAX_THREADS] = {0};
    for (int k = 0; k < threads; k++) {
        GatherJob *j = &jobs[k];
        j->dst = dst, j->src = src, j->ids = ids, j->src_offs = so, j->dst_offs = dof;
        j->n = n, j->chunk = chunk, j->wide = wide;
        j->begin = total * k / threads, j->end = total * (k + 1) / threads;
    }
    for (int k = 1; k < threads; k++)
        started[k] = pthread_create(&tid[k], NULL, gather_run_thread, &jobs[k]) == 0;
    gather_run(&jobs[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k])
            pthread_join(tid[k], NULL);
        else
            gather_run(&jobs[k]);   /* no thread to be had: do its share here */
    }
}

#endif
