// shmcache/_native/copy.h: the KV read's copy of one chunk (one head of one
// block, K or V), used by mlxbuf.cpp. No Python and no threads here.
//
// ChunkCopy copy(total);        // total: the bytes the whole read copies
// copy(dst, src, nbytes);       // once per chunk, any sizes and alignments
//                               // (fenced when `copy` goes out of scope)
//
// NOTE: hand-written 32-byte loads and stores, not memcpy, where the CPU has
// AVX2: on the development VM one memcpy per 2 KiB chunk was the slowest copy
// measured, and this loop (commit e0fa556's) 1.4-1.6x faster with ordinary
// stores and 1.9-2.1x with streaming ones at 1-8 MiB (docs/performance.md,
// "KV read path").
#ifndef SHMCACHE_COPY_H
#define SHMCACHE_COPY_H

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace shmcache {

// NOTE: reads of 4 MiB or more in all (K and V) stream their stores past
// the cache (non-temporal, as glibc's memcpy does for large copies): they
// skip reading each destination line before writing it, but leave the
// result in memory, not in cache. On the development VM (1 MiB L2 per core,
// 32 MiB L3), against ordinary stores, in the full read: with the source in
// memory, as the engine reads (every layer of a prefix in turn, far more
// than the L3), 1.1-1.55x at 4 MiB and 1.35-1.5x at 6-32 MiB; with the
// source in cache, 0.8-1.1x at 4 MiB and 1.6-2.5x at 6-16 MiB. Below 4 MiB
// streaming won less with the source in memory (0.95-1.4x) and lost with it
// in cache (0.62-0.77x at 1-2 MiB, 0.86x at 3 MiB, where `make bench`
// measures its 64-block reads), and ordinary stores leave a result that
// fits the caches in them for whoever reads it next. docs/performance.md,
// "KV read path", has the runs.
constexpr int64_t kStreamFrom = int64_t{4} << 20;

inline void copy_plain(char* d, const char* s, int64_t c) {
  std::memcpy(d, s, static_cast<size_t>(c));
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) inline void copy_avx2(char* d, const char* s, int64_t c) {
  int64_t b = 0;
  for (; b + 128 <= c; b += 128) {
    __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b));
    __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b + 32));
    __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b + 64));
    __m256i a3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b + 96));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + b), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + b + 32), a1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + b + 64), a2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + b + 96), a3);
  }
  copy_plain(d + b, s + b, c - b);
}

// NOTE: a copy of copy_avx2 with other stores, on purpose: one loop with a
// run-time streaming flag in it made the 64-block read twice as slow
// (e0fa556's tools/bench/profile_read_kv). Streaming stores need a 32-byte aligned
// destination: the bytes before the first boundary and after the last whole
// 128 go through memcpy.
__attribute__((target("avx2"))) inline void copy_avx2_stream(char* d, const char* s, int64_t c) {
  int64_t head = static_cast<int64_t>(-reinterpret_cast<uintptr_t>(d) & 31);
  head = head < c ? head : c;
  copy_plain(d, s, head);
  d += head, s += head, c -= head;
  int64_t b = 0;
  for (; b + 128 <= c; b += 128) {
    __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b));
    __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b + 32));
    __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b + 64));
    __m256i a3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + b), a0);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + b + 32), a1);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + b + 64), a2);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + b + 96), a3);
  }
  copy_plain(d + b, s + b, c - b);
}
#endif

// The copy of one read's chunks, its loop picked once from the CPU and the
// read's size. Invariants: it streams only where the CPU has AVX2, and a
// read that streamed is fenced (_mm_sfence: streaming stores are weakly
// ordered) before the object goes away, so the bytes are visible to any
// thread that is handed them afterwards.
class ChunkCopy {
 public:
  explicit ChunkCopy(int64_t total) {
#if defined(__x86_64__)
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2)
      fn_ = total >= kStreamFrom ? copy_avx2_stream : copy_avx2;
    streams_ = fn_ == copy_avx2_stream;
#else
    (void)total;
#endif
  }
  ~ChunkCopy() {
#if defined(__x86_64__)
    if (streams_)
      _mm_sfence();
#endif
  }
  ChunkCopy(const ChunkCopy&) = delete;
  ChunkCopy& operator=(const ChunkCopy&) = delete;

  void operator()(char* d, const char* s, int64_t c) const { fn_(d, s, c); }

 private:
  void (*fn_)(char*, const char*, int64_t) = copy_plain;
  bool streams_ = false;
};

}  // namespace shmcache

#endif
