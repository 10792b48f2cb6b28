// shmcache/_native/bind_args.h: the binding side of shmcache._hot (hot.cpp
// includes it): the Hot object that Python sees, and how its methods take
// their arguments and raise. Unlike the hot_*.h core, it needs Python and
// nanobind.
//
// NOTE: the arguments are taken as handles and converted as the
// PyArg_ParseTuple codes of the C module this replaced did ("n", "i", "L",
// "d", "K", "y#", "w*"), not by nanobind's casters: the same types pass and
// the same exceptions are raised (an int too large is an OverflowError, a
// bool is an int but free() and table_take() refuse anything that is not
// exactly an int as a block id), and a handle costs no conversion.
#ifndef SHMCACHE_BIND_ARGS_H
#define SHMCACHE_BIND_ARGS_H

#include <nanobind/nanobind.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "hot_params.h"
#include "hot_localmap.h"
#include "hot_enter.h"
#include "hot_reserve.h"

#include <time.h>

namespace nb = nanobind;

// (a named namespace: hot.cpp, the one unit that includes this, uses it)
namespace hotbind {

// The Python object. Invariant: while has_view, core views view's buffer.
struct Hot {
    Py_buffer view;
    bool has_view = false;
    HotCore core;
    // how long each wait of a fused op for the lock took (for its turn,
    // and in the kernel), in ns, while log_waits() is on (tools/bench/scale
    // counts them with the slow path's)
    bool log_waits = false;
    std::vector<int64_t> waits;
    // the hold trace's buffer (log_holds(2): core.trace points into it)
    std::vector<int64_t> trace;
    // this process's reserve (hot_reserve.h): the ids it put in, and how
    // many it may hold (0: no reserve)
    std::vector<int32_t> stash;
    int64_t stash_n = 0;

    Stash stash_view() { return Stash{stash.data(), stash_n, (int64_t)stash.size()}; }

    Hot() = default;
    Hot(const Hot &) = delete;
    Hot &operator=(const Hot &) = delete;
    ~Hot() { release(); }

    void release() {
        if (has_view) {
            PyBuffer_Release(&view);
            has_view = false;
        }
    }
};

[[noreturn]] void throw_error() { throw nb::python_error(); }

[[noreturn]] void raise_no_memory() {
    PyErr_NoMemory();
    throw_error();
}

// PyArg_ParseTuple's message for an argument of the wrong type.
[[noreturn]] void raise_wrong_type(int argn, const char *expected, nb::handle o) {
    PyErr_Format(PyExc_TypeError, "argument %d must be %.50s, not %.50s", argn, expected,
                 o.is_none() ? "None" : Py_TYPE(o.ptr())->tp_name);
    throw_error();
}

HotCore *ready(Hot &h) {
    if (!h.has_view)
        throw nb::value_error("pool mapping already released");
    return &h.core;
}

// ------------------------------------------------- the argument conversions

Py_ssize_t as_n(nb::handle o) {             // "n": an int, or an object with __index__
    PyObject *p = o.ptr();
    Py_ssize_t v;
    if (PyLong_CheckExact(p)) {
        v = PyLong_AsSsize_t(p);
    } else {
        PyObject *i = PyNumber_Index(p);
        if (!i)
            throw_error();
        v = PyLong_AsSsize_t(i);
        Py_DECREF(i);
    }
    if (v == -1 && PyErr_Occurred())
        throw_error();
    return v;
}

int as_i(nb::handle o) {                    // "i"
    long v = PyLong_AsLong(o.ptr());
    if (v == -1 && PyErr_Occurred())
        throw_error();
    if (v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "signed integer is greater than maximum");
        throw_error();
    }
    if (v < INT_MIN) {
        PyErr_SetString(PyExc_OverflowError, "signed integer is less than minimum");
        throw_error();
    }
    return (int)v;
}

long long as_L(nb::handle o) {              // "L"
    long long v = PyLong_AsLongLong(o.ptr());
    if (v == -1 && PyErr_Occurred())
        throw_error();
    return v;
}

double as_d(nb::handle o) {                 // "d"
    if (PyFloat_CheckExact(o.ptr()))
        return PyFloat_AS_DOUBLE(o.ptr());
    double v = PyFloat_AsDouble(o.ptr());
    if (v == -1.0 && PyErr_Occurred())
        throw_error();
    return v;
}

uint64_t as_K(nb::handle o, int argn) {     // "K": an int, masked to 64 bits
    if (!PyLong_Check(o.ptr()))
        raise_wrong_type(argn, "int", o);
    return (uint64_t)PyLong_AsUnsignedLongLongMask(o.ptr());
}

// "y#": bytes, or a read-only bytes-like object (none that must be released).
const char *as_y(nb::handle o, int argn, Py_ssize_t *n) {
    PyObject *p = o.ptr();
    if (PyBytes_Check(p)) {
        *n = PyBytes_GET_SIZE(p);
        return PyBytes_AS_STRING(p);
    }
    PyBufferProcs *pb = Py_TYPE(p)->tp_as_buffer;
    if (pb && pb->bf_releasebuffer)
        raise_wrong_type(argn, "read-only bytes-like object", o);
    Py_buffer v;
    if (PyObject_GetBuffer(p, &v, PyBUF_SIMPLE) < 0)
        throw_error();                      // (its TypeError, as PyArg_ParseTuple's)
    *n = v.len;
    const char *buf = (const char *)v.buf;
    PyBuffer_Release(&v);
    return buf;
}

// "w*": a writable C-contiguous buffer, held until the end of the call.
struct WritableBuffer {
    Py_buffer v;
    bool held = false;

    WritableBuffer(nb::handle o, int argn) {
        if (PyObject_GetBuffer(o.ptr(), &v, PyBUF_WRITABLE) < 0) {
            PyErr_Clear();
            raise_wrong_type(argn, "read-write bytes-like object", o);
        }
        if (!PyBuffer_IsContiguous(&v, 'C')) {
            PyBuffer_Release(&v);
            raise_wrong_type(argn, "contiguous buffer", o);
        }
        held = true;
    }
    WritableBuffer(const WritableBuffer &) = delete;
    WritableBuffer &operator=(const WritableBuffer &) = delete;
    ~WritableBuffer() {
        if (held)
            PyBuffer_Release(&v);
    }
};

// Block ids read from Python: on the stack up to N, else on the heap.
template <int64_t N>
struct Ids {
    int32_t stack[N];
    int32_t *p = stack;

    explicit Ids(int64_t n) {
        if (n > N) {
            p = (int32_t *)malloc((size_t)n * sizeof(int32_t));
            if (!p)
                raise_no_memory();
        }
    }
    Ids(const Ids &) = delete;
    Ids &operator=(const Ids &) = delete;
    ~Ids() {
        if (p != stack)
            free(p);
    }
};

// The block ids of a sequence (PySequence_Fast's), into bs: false when one
// is not exactly an int in [1, max_blocks) (the Python path then says why).
bool read_ids(const HotCore *h, PyObject *fast, int32_t *bs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyLong_CheckExact(o))
            return false;
        long v = PyLong_AsLong(o);
        if (!hot_is_block(h, v)) {
            PyErr_Clear();
            return false;
        }
        bs[i] = (int32_t)v;
    }
    return true;
}

// The manager's LooseMap array as the core's map: ValueError when its size
// is not the one LooseMap gives a pool of h's sizes.
void open_map(const HotCore *h, const WritableBuffer &lv, LMap *lm) {
    if (lm_open(h, lv.v.buf, lv.v.len, lm) < 0) {
        long long b = lm_blocks(h), w = lm_words(h);
        PyErr_Format(PyExc_ValueError, "the loose map must be a writable int32 array of "
                     "%lld items (2 * %lld blocks + 2 * %lld words), got %zd bytes",
                     2 * b + 2 * w, b, w, lv.v.len);
        throw_error();
    }
}

nb::object int_result(int64_t v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (!o)
        throw_error();
    return nb::steal(o);
}

nb::object fast_seq(nb::handle seq, const char *what) {
    return nb::steal(PySequence_Fast(seq.ptr(), what));
}

// This process's count of timed-lock slices that ran out (lock_bounded),
// for tests.
inline long lock_slices_expired;

// How many times a fused op whose lock stayed busy waits for it in the
// kernel and tries again before it leaves the op to the slow path.
constexpr int FUSED_RETRIES = 3;

int64_t now_ns() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// The lock stayed busy through a fused op's spin: sleep until it is free
// (GIL released) and hand it back (hot_wait_lock says why). True when the
// op may be tried again.
bool wait_lock(Hot &self) {
    HotCore *h = ready(self);
    int64_t t0 = self.log_waits ? now_ns() : 0;
    int e;
    {
        nb::gil_scoped_release unlocked;
        e = hot_wait_lock(h, &lock_slices_expired);
    }
    if (self.log_waits)
        self.waits.push_back(now_ns() - t0);
    return e == 0 && self.has_view;
}

// Run a fused op (op() -> its result), logging how long it waited for its
// turn at the lock (hot_enter.h's take_turn) when the waits are logged.
template <class Op>
int64_t logged(Hot &self, Op &op) {
    HotCore *h = ready(self);
    h->turn_wait_ns = 0;
    int64_t r = op();
    if (self.log_waits && h->turn_wait_ns)
        self.waits.push_back(h->turn_wait_ns);
    return r;
}

// Run a fused op and, while it finds the lock busy, wait in the kernel
// for the lock and run it again, FUSED_RETRIES times at most.
template <class Op>
int64_t retried(Hot &self, Op op) {
    int64_t r = logged(self, op);
    for (int k = 0; r == HOT_BUSY && k < FUSED_RETRIES && wait_lock(self); k++)
        r = logged(self, op);
    return r;
}

// table_append's accept: the list of the ids, built before the core's
// first write, so that a MemoryError changes nothing.
int build_list(void *ctx, const int32_t *ids, int64_t n) {
    PyObject *list = PyList_New(n);
    for (int64_t i = 0; list && i < n; i++) {
        PyObject *o = PyLong_FromLong(ids[i]);
        if (!o)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, o);
    }
    *(PyObject **)ctx = list;
    return list ? 0 : -1;
}

}  // namespace hotbind

#endif
