/* shmcache._gather: the KV read's one copy, from scattered arena chunks into
 * one destination buffer, in C.
 *
 * gather(dst, src, ids, src_offsets, dst_offsets, chunk, threads[, stride[,
 *        stream_above[, shared_stream_above]]])
 * copies, for every i and every j, the `chunk` bytes at
 * src + src_offsets[j] + ids[i]*stride (stride defaults to chunk) to
 * dst + dst_offsets[j] + i*chunk, with non-temporal stores when the copy
 * exceeds stream_above bytes (default 4 MiB), or shared_stream_above
 * (default stream_above) for what is copied while a helper thread shares
 * it (see _gather.h). In the arena (see layout) i runs over the requested
 * blocks and j over (K|V, head) of one layer.
 *
 * Every offset is checked against both buffers before anything is copied
 * (ValueError otherwise, nothing written), and the copy runs with the GIL
 * released, split over `threads` threads (the caller's plus threads-1 kept
 * helpers, see _gather_pool.h).
 *
 * pool_stats() counts what the helper pool did (see _gather_pool.h).
 *
 * The copy itself (and why it is not numpy's take) is in _gather.h, which
 * shmcache._mlxbuf's read_layer shares.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_gather.h"

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

static PyObject *
gather(PyObject *self, PyObject *args)
{
    PyObject *dst_o, *src_o, *ids_o, *so_o, *do_o;
    long long chunk, stride = -1, stream_above = GATHER_STREAM_BYTES, shared = -1;
    int threads;
    Py_buffer dst = {0}, src = {0}, ids = {0}, so = {0}, dof = {0};
    PyObject *ret = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOLi|LLL", &dst_o, &src_o, &ids_o, &so_o, &do_o, &chunk,
                          &threads, &stride, &stream_above, &shared))
        return NULL;
    if (PyTuple_GET_SIZE(args) < 8)
        stride = chunk;
    if (PyTuple_GET_SIZE(args) < 10)
        shared = stream_above;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    if (PyObject_GetBuffer(src_o, &src, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (get_i64(ids_o, &ids, "ids") < 0 || get_i64(so_o, &so, "src_offsets") < 0 ||
        get_i64(do_o, &dof, "dst_offsets") < 0)
        goto done;
    if (dof.len != so.len) {
        PyErr_Format(PyExc_ValueError, "%lld src_offsets but %lld dst_offsets",
                     (long long)(so.len / 8), (long long)(dof.len / 8));
        goto done;
    }
    char msg[256];
    int64_t n = ids.len / 8, m = so.len / 8;
    if (gather_check(dst.len, src.len, ids.buf, n, stride, so.buf, dof.buf, m, chunk, msg,
                     sizeof msg)) {
        PyErr_SetString(PyExc_ValueError, msg);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    gather_copy(dst.buf, src.buf, ids.buf, n, stride, so.buf, dof.buf, m, chunk, threads,
                stream_above, shared);
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

static PyObject *
pool_stats(PyObject *self, PyObject *noargs)
{
    int64_t c[4];
    gather_pool_stats(c);
    return Py_BuildValue("{sLsLsLsL}", "helpers", (long long)c[0], "shared", (long long)c[1],
                         "skipped", (long long)c[2], "backoffs", (long long)c[3]);
}

/* Tests only: helpers sleep `ns` before each grain, as if preempted. */
static PyObject *
set_helper_delay(PyObject *self, PyObject *arg)
{
    long long ns = PyLong_AsLongLong(arg);
    if (ns == -1 && PyErr_Occurred())
        return NULL;
    if (ns < 0 || ns >= 1000000000) {
        PyErr_Format(PyExc_ValueError, "delay must be in [0, 1e9) ns, got %lld", ns);
        return NULL;
    }
    __atomic_store_n(&gather_pool.test_delay_ns, (int64_t)ns, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pool_stats", pool_stats, METH_NOARGS,
     "pool_stats() -> {helpers, shared, skipped, backoffs}: this module's helper pool (see "
     "_gather_pool.h): jobs shared with helpers, jobs run alone while backing off, back-offs"},
    {"_set_helper_delay", set_helper_delay, METH_O,
     "_set_helper_delay(ns): tests only; helpers sleep ns before each grain"},
    {"gather", gather, METH_VARARGS,
     "gather(dst, src, ids, src_offsets, dst_offsets, chunk, threads[, stride[, stream_above[,"
     " shared_stream_above]]]) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "shmcache._gather", NULL, -1,
                                    methods};

PyMODINIT_FUNC
PyInit__gather(void)
{
    return PyModule_Create(&module);
}
