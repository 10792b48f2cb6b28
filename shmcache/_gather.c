/* shmcache._gather: the KV read's one copy, from scattered arena chunks into
 * one destination buffer, in C.
 *
 * gather(dst, src, ids, src_offsets, dst_offsets, chunk, threads) copies, for
 * every j and every i, the `chunk` bytes at src + src_offsets[j] + ids[i]*chunk
 * to dst + dst_offsets[j] + i*chunk. In the arena (see layout) one layer's K
 * (or V) of one head is max_blocks chunks of block_size*head_dim items, so j
 * runs over (K|V, head) and i over the requested blocks.
 *
 * Every offset is checked against both buffers before anything is copied
 * (ValueError otherwise, nothing written), and the copy runs with the GIL
 * released, split over `threads` threads (the caller's plus threads-1 new).
 *
 * NOTE: why not numpy's take: a 2-4 KiB chunk is too short for the hardware
 * prefetcher to ramp up on, and take copies chunk by chunk in one thread. We
 * prefetch the chunk PF_AHEAD places ahead, copy with 32-byte loads and stores
 * where the CPU has them, and use the second core: together about 2x take's
 * bandwidth on the 2-core development VM (tools/bench_workers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_THREADS 8
#define PF_AHEAD 2

typedef struct {
    char *dst;
    const char *src;
    const int64_t *ids, *src_offs, *dst_offs;
    int64_t n, chunk, begin, end;   /* tasks [begin, end) of m*n */
    int wide;
} Job;

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void
copy_wide(char *d, const char *s, int64_t c)
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
src_of(const Job *j, int64_t t)
{
    return j->src + j->src_offs[t / j->n] + j->ids[t % j->n] * j->chunk;
}

static void
run(const Job *j)
{
    for (int64_t t = j->begin; t < j->end; t++) {
        if (t + PF_AHEAD < j->end) {
            const char *p = src_of(j, t + PF_AHEAD);
            for (int64_t b = 0; b < j->chunk; b += 64)
                __builtin_prefetch(p + b, 0, 3);
        }
        char *d = j->dst + j->dst_offs[t / j->n] + (t % j->n) * j->chunk;
#if defined(__x86_64__)
        if (j->wide) {
            copy_wide(d, src_of(j, t), j->chunk);
            continue;
        }
#endif
        memcpy(d, src_of(j, t), (size_t)j->chunk);
    }
}

static void *
run_thread(void *arg)
{
    run((const Job *)arg);
    return NULL;
}

static int
get_i64(PyObject *o, Py_buffer *v, const char *what)
{
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (v->itemsize != 8 || !v->format || !strchr("qlQL", v->format[0]) || v->format[1]) {
        PyErr_Format(PyExc_TypeError, "%s must be a buffer of int64", what);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static int
check(Py_buffer *dst, Py_buffer *src, Py_buffer *ids, Py_buffer *so, Py_buffer *dof,
      int64_t chunk)
{
    const int64_t *id = ids->buf, *s = so->buf, *d = dof->buf;
    int64_t n = ids->len / 8, m = so->len / 8, lo = INT64_MAX, hi = -1;
    if (chunk <= 0)
        return PyErr_Format(PyExc_ValueError, "chunk must be positive, got %lld",
                            (long long)chunk), -1;
    if (dof->len != so->len)
        return PyErr_Format(PyExc_ValueError, "%lld src_offsets but %lld dst_offsets",
                            (long long)m, (long long)(dof->len / 8)), -1;
    for (int64_t i = 0; i < n; i++) {
        lo = id[i] < lo ? id[i] : lo;
        hi = id[i] > hi ? id[i] : hi;
    }
    if (n && lo < 0)
        return PyErr_Format(PyExc_ValueError, "negative id %lld", (long long)lo), -1;
    for (int64_t j = 0; j < m; j++) {
        int64_t end;
        if (s[j] < 0 || (n && (__builtin_mul_overflow(hi + 1, chunk, &end) ||
                               __builtin_add_overflow(end, s[j], &end) || end > src->len)))
            return PyErr_Format(PyExc_ValueError,
                                "src_offsets[%lld]=%lld with id %lld reads past the "
                                "source (%zd bytes)", (long long)j, (long long)s[j],
                                (long long)hi, src->len), -1;
        if (d[j] < 0 || __builtin_mul_overflow(n, chunk, &end) ||
            __builtin_add_overflow(end, d[j], &end) || end > dst->len)
            return PyErr_Format(PyExc_ValueError,
                                "dst_offsets[%lld]=%lld with %lld chunks writes past the "
                                "destination (%zd bytes)", (long long)j, (long long)d[j],
                                (long long)n, dst->len), -1;
    }
    return 0;
}

static PyObject *
gather(PyObject *self, PyObject *args)
{
    PyObject *dst_o, *src_o, *ids_o, *so_o, *do_o;
    long long chunk;
    int threads;
    Py_buffer dst = {0}, src = {0}, ids = {0}, so = {0}, dof = {0};
    PyObject *ret = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOLi", &dst_o, &src_o, &ids_o, &so_o, &do_o, &chunk,
                          &threads))
        return NULL;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    if (PyObject_GetBuffer(src_o, &src, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (get_i64(ids_o, &ids, "ids") < 0 || get_i64(so_o, &so, "src_offsets") < 0 ||
        get_i64(do_o, &dof, "dst_offsets") < 0)
        goto done;
    if (check(&dst, &src, &ids, &so, &dof, chunk) < 0)
        goto done;

    int64_t n = ids.len / 8, total = n * (so.len / 8);
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (threads > total)
        threads = total > 0 ? (int)total : 1;
    int wide = 0;
#if defined(__x86_64__)
    wide = chunk % 128 == 0 && __builtin_cpu_supports("avx2");
#endif
    Job jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int k = 0; k < threads; k++)
        jobs[k] = (Job){dst.buf, src.buf, ids.buf, so.buf, dof.buf, n, chunk,
                        total * k / threads, total * (k + 1) / threads, wide};
    Py_BEGIN_ALLOW_THREADS
    for (int k = 1; k < threads; k++)
        started[k] = pthread_create(&tid[k], NULL, run_thread, &jobs[k]) == 0;
    run(&jobs[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k])
            pthread_join(tid[k], NULL);
        else
            run(&jobs[k]);   /* no thread to be had: do its share here */
    }
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (dst.obj) PyBuffer_Release(&dst);
    if (src.obj) PyBuffer_Release(&src);
    if (ids.obj) PyBuffer_Release(&ids);
    if (so.obj) PyBuffer_Release(&so);
    if (dof.obj) PyBuffer_Release(&dof);
    return ret;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(dst, src, ids, src_offsets, dst_offsets, chunk, threads) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "shmcache._gather", NULL, -1,
                                    methods};

PyMODINIT_FUNC
PyInit__gather(void)
{
    return PyModule_Create(&module);
}
