/* shmcache/_gather.h: the KV read's one copy, shared by shmcache._gather (C)
 * and shmcache._mlxbuf (C++). No Python here: callers check, then copy with
 * the GIL released.
 *
 * gather_copy(dst, src, ids, n, stride, src_offs, dst_offs, m, chunk, threads,
 *             stream_above, shared_stream_above)
 * copies, for every i < n and every j < m, the `chunk` bytes at
 * src + src_offs[j] + ids[i]*stride to dst + dst_offs[j] + i*chunk, block by
 * block (i outer), split over `threads` threads (the caller's plus up to
 * threads-1 kept helpers, see _gather_pool.h). In the arena (see layout) a
 * block's K and V of all heads in one layer are 2*H consecutive chunks, so
 * j runs over (K|V, head) and the source is read in runs of 2*H*chunk bytes.
 *
 * gather_check(...) returns NULL when every such copy stays inside both
 * buffers, else a message naming what is out of bounds (written into msg).
 *
 * NOTE: block by block because the source then comes in runs of 8-16 KiB,
 * which the hardware prefetcher follows, where head by head it came in 2-4
 * KiB chunks from scattered pages: 10-30% faster on the development VM, and
 * software prefetch on top of it was slower. Copies use 32-byte loads and
 * stores where the CPU has them; large reads may be split over threads.
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
/* NOTE: copies of more than stream_above bytes in all use non-temporal
 * stores (into 32-byte aligned destinations), as glibc's memcpy does for
 * large copies: they skip reading each destination line before writing it,
 * but leave the result out of cache. Grains copied while a helper shares
 * the job (see _gather_pool.h) use shared_stream_above instead: two cores
 * have twice the line-fill buffers, and there ordinary stores, which keep
 * the result in cache, were the faster (shmcache.kv passes 3/8 of the L3,
 * see kv._shared_stream_bytes, with the figures). With one thread and the
 * block-major arena, 8-16 MiB gathers went from 0.31-0.82x of np.copyto to
 * 0.78-1.47x streamed, while 1-2 MiB ones went from 0.61-0.78x down to
 * 0.49-0.61x: hence the default, for both, of 4 MiB. */
#define GATHER_STREAM_BYTES (4 << 20)

typedef struct {
    char *dst;
    const char *src;
    const int64_t *ids, *src_offs, *dst_offs;
    int64_t n, m, stride, chunk, begin, end;   /* tasks [begin, end) of n*m */
    int wide, stream, shared_stream;   /* stream: this run; shared_stream: with a helper */
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

/* NOTE: a copy of gather_copy_wide on purpose: one function with a run-time
 * streaming flag in its loop made the 64-block copy twice as slow (26.7 ->
 * 61 us, tools/profile_read_kv), and a forced-inline variant was still slower. */
__attribute__((target("avx2"))) static void
gather_copy_stream(char *d, const char *s, int64_t c)
{
    for (int64_t b = 0; b < c; b += 128) {
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(s + b));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(s + b + 32));
        __m256i a2 = _mm256_loadu_si256((const __m256i *)(s + b + 64));
        __m256i a3 = _mm256_loadu_si256((const __m256i *)(s + b + 96));
        _mm256_stream_si256((__m256i *)(d + b), a0);
        _mm256_stream_si256((__m256i *)(d + b + 32), a1);
        _mm256_stream_si256((__m256i *)(d + b + 64), a2);
        _mm256_stream_si256((__m256i *)(d + b + 96), a3);
    }
}
#endif

static void
gather_run(const GatherJob *j)
{
    for (int64_t t = j->begin; t < j->end; t++) {
        int64_t i = t / j->m, k = t % j->m;
        const char *s = j->src + j->src_offs[k] + j->ids[i] * j->stride;
        char *d = j->dst + j->dst_offs[k] + i * j->chunk;
#if defined(__x86_64__)
        if (j->stream && ((uintptr_t)d & 31) == 0) {
            gather_copy_stream(d, s, j->chunk);
            continue;
        }
        if (j->wide) {
            gather_copy_wide(d, s, j->chunk);
            continue;
        }
#endif
        memcpy(d, s, (size_t)j->chunk);
    }
#if defined(__x86_64__)
    if (j->stream)
        _mm_sfence();   /* streamed stores are weakly ordered: drain them before we return */
#endif
}

#include "_gather_pool.h"

static const char *
gather_check(int64_t dst_len, int64_t src_len, const int64_t *id, int64_t n, int64_t stride,
             const int64_t *s, const int64_t *d, int64_t m, int64_t chunk,
             char *msg, size_t msglen)
{
    int64_t lo = INT64_MAX, hi = -1;
    if (chunk <= 0) {
        snprintf(msg, msglen, "chunk must be positive, got %lld", (long long)chunk);
        return msg;
    }
    if (stride < 0) {
        snprintf(msg, msglen, "stride must not be negative, got %lld", (long long)stride);
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
        if (s[j] < 0 || (n && (__builtin_mul_overflow(hi, stride, &end) ||
                               __builtin_add_overflow(end, s[j], &end) ||
                               __builtin_add_overflow(end, chunk, &end) || end > src_len))) {
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
gather_copy(char *dst, const char *src, const int64_t *ids, int64_t n, int64_t stride,
            const int64_t *so, const int64_t *dof, int64_t m, int64_t chunk, int threads,
            int64_t stream_above, int64_t shared_stream_above)
{
    int64_t total = n * m;
    threads = threads < 1 ? 1 : threads > GATHER_MAX_THREADS ? GATHER_MAX_THREADS : threads;
    if (threads > total)
        threads = total > 0 ? (int)total : 1;
    int wide = 0;
#if defined(__x86_64__)
    wide = chunk % 128 == 0 && __builtin_cpu_supports("avx2");
#endif
    GatherJob j;
    j.dst = dst, j.src = src, j.ids = ids, j.src_offs = so, j.dst_offs = dof;
    j.n = n, j.m = m, j.stride = stride, j.chunk = chunk, j.wide = wide;
    j.stream = wide && total * chunk > stream_above;
    j.shared_stream = wide && total * chunk > shared_stream_above;
    j.begin = 0, j.end = total;
    if (threads > 1 && gather_pool_run(&j, total, threads))
        return;
    gather_run(&j);   /* one thread asked for, or the pool is taken: alone */
}

#endif
