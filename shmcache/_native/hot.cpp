// shmcache._hot: the pool mutex, the two operations a scheduler calls on
// every step (allocate blocks, free a batch of them), and the table calls
// of a request's life (take a cached prefix into a table, append, delete),
// in C, bound with nanobind.
//
// This file is the binding: the Hot object (its creation, set_chunks, its
// release) and its methods, which convert the arguments, call the core and
// turn its codes into Python results: HOT_SLOW into None (the Python path
// runs), HOT_NOMEM into MemoryError, an errno into OSError. It is the one
// translation unit; the core is in headers it includes, plain C/C++ with no
// Python, one role each:
//   hot_params.h    HotCore: the pool fields the core reaches, and their checks
//                   (hot_params_gen.h, generated from layout.HOT_PARAMS,
//                   indexes them);
//   hot_mutex.h     the robust pool mutex;
//   hot_enter.h     how a fused op takes it: its turn, a short spin, the
//                   dirty mark, the release that hands the turn on;
//   hot_localmap.h  the process-local map of a slot's loose references
//                   (loosemap.py's int32 array, shared with numpy);
//   hot_loose.h     alloc() and free(): fused, they take the lock themselves
//                   and only ever try it (None: the slow path runs);
//   hot_reserve.h   the process's reserve of free blocks, which alloc() and
//                   free() take from and fill first, without the lock;
//   hot_tables.h    table_new(), table_drop(), and the checks of the table
//                   ops, which run inside a lock hold the Python caller took;
//   hot_append.h    table_take(), table_append(): a table's list grows;
//   hot_index.h     find_chain(): the prefix lookup, in the same lock hold,
//                   and the publication of blocks in the prefix index;
//   hot_fused.h     new_table(), delete_table(), append(), acquire(),
//                   add_block(), lookup(), publish(): ops that take the lock
//                   themselves.
// The Python paths stay the reference (fastpath.py, tables.py, prefix.py,
// index.py): each C path does what its Python path does (a table op, what
// it does after its lookups), and None means the Python path runs.
// bind_args.h holds the Hot object and how the methods take their
// arguments (as the PyArg_ParseTuple codes of the C module this replaced);
// bind_tables.h the methods of the table ops and the prefix lookup.
// The pool's mapping is held (PyObject_GetBuffer, writable) for the
// object's life, until release(); the loose map for one call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <new>

#include "hot_params.h"
#include "hot_enter.h"
#include "hot_mutex.h"
#include "hot_loose.h"
#include "hot_reserve.h"
#include "hot_tables.h"
#include "hot_append.h"
#include "hot_index.h"
#include "hot_fused.h"

#include "bind_args.h"
#include "bind_tables.h"

using namespace hotbind;

namespace {

// ------------------------------------------------------- the Hot object

// Hot(buffer, params, created_at=0.0): the pool mutex and fused operations
// over a writable buffer of the pool's mapping (held until release()), with
// the parameters params (a tuple of ints: layout.HOT_PARAMS' values, in its
// order, which hot_params_gen.h's P_ enum indexes).
void hot_init(Hot *self, nb::handle buf, nb::handle params, nb::handle created_at_) {
    if (!PyTuple_Check(params.ptr()))
        raise_wrong_type(2, "tuple", params);
    double created_at = as_d(created_at_);
    if (PyTuple_GET_SIZE(params.ptr()) != P_COUNT) {
        PyErr_Format(PyExc_ValueError, "Hot() takes %d parameters, got %zd",
                     (int)P_COUNT, PyTuple_GET_SIZE(params.ptr()));
        throw_error();
    }
    int64_t p[P_COUNT];
    for (int i = 0; i < P_COUNT; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(params.ptr(), i));
        if (v == -1 && PyErr_Occurred())
            throw_error();
        p[i] = v;
    }
    // (constructed before the buffer is taken into it; nanobind destroys
    // the object only once this returns, so every failure below releases)
    Hot *h = new (self) Hot();
    if (PyObject_GetBuffer(buf.ptr(), &h->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        throw_error();
    h->has_view = true;
    if (const char *why = hot_open(&h->core, h->view.buf, h->view.len, p, created_at)) {
        h->release();
        throw nb::value_error(why);
    }
}

nb::object hot_set_chunks_py(Hot &self, nb::handle n_) {
    Py_ssize_t n = as_n(n_);
    HotCore *h = ready(self);
    int e = hot_set_chunks(h, n);
    if (e == -1) {
        PyErr_Format(PyExc_ValueError, "%zd chunks do not fit the mapping (room for %zd)",
                     n, (Py_ssize_t)hot_chunks_room(h));
        throw_error();
    }
    if (e < 0)
        throw nb::value_error("bad generation offset or token counter");
    return nb::none();
}

// ---------------------------------------------------------------- the mutex

[[noreturn]] void raise_errno(int e) {
    errno = e;
    PyErr_SetFromErrno(PyExc_OSError);
    throw_error();
}

nb::object hot_init_mutex_py(Hot &self) {
    int e = hot_init_mutex(ready(self));
    if (e)
        raise_errno(e);
    return nb::none();
}

nb::object hot_trylock_py(Hot &self) {
    return int_result(hot_trylock(ready(self)));
}

nb::object hot_lock_py(Hot &self, bool give_up) {
    HotCore *h = ready(self);
    int e;
    {
        nb::gil_scoped_release unlocked;
        e = hot_lock(h, &lock_slices_expired, give_up);
    }
    if (e == 0 || e == EOWNERDEAD)
        return int_result(e == EOWNERDEAD);
    if (e == LOCK_OWNER_STUCK)
        return int_result(-2);
    raise_errno(e);
}

nb::object hot_unlock_py(Hot &self) {
    int e = hot_unlock(ready(self));
    if (e)
        raise_errno(e);
    return nb::none();
}

// ------------------------------------------------------- the fused ops

// alloc(n, slot, epoch, loose) -> list of n block ids, or None (nothing
// changed; also when the lock stayed busy through FUSED_RETRIES waits).
nb::object hot_alloc_py(Hot &self, nb::handle n_, nb::handle slot_, nb::handle epoch_,
                        nb::handle loose) {
    Py_ssize_t n = as_n(n_);
    int slot = as_i(slot_);
    long long epoch = as_L(epoch_);
    WritableBuffer lv(loose, 4);
    HotCore *h = ready(self);
    // (more than the pool has: the slow path raises, before any allocation)
    if (!hot_alloc_ok(h, n, slot))
        return nb::none();
    LMap lm;
    open_map(h, lv, &lm);
    Ids<64> ids(n);
    int64_t r = 0;
    if (self.stash_n >= n) {
        Stash st = self.stash_view();
        r = hot_stash_take(h, n, slot, &st, ids.p);
        self.stash_n = st.n;
    }
    if (r != n)
        r = retried(self, [&] { return (int64_t)hot_alloc(h, n, slot, epoch, &lm, ids.p); });
    if (r == HOT_NOMEM)
        raise_no_memory();
    if (r <= 0)                             // (0, or HOT_BUSY still)
        return nb::none();
    // committed, the local map too: a failure here leaves the caller to
    // rebuild the map from the slot's list (paged_cache.PagedCacheManager._native)
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *bo = PyLong_FromLong(ids.p[i]);
        if (!bo)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, bo);
    }
    if (!list) {
        PyErr_Clear();
        PyErr_SetString(PyExc_MemoryError, "loose-reference map must be resynced");
        throw_error();
    }
    return nb::steal(list);
}

// free(ids, slot, epoch, loose) -> number of blocks that became free, or
// None (nothing changed) when an id is not an int in [1, max_blocks), is not
// held loose by this slot as many times as listed (the slow path then
// raises the precise error), or the lock stayed busy through FUSED_RETRIES
// waits for the lock (the slow path then waits for it in Python).
nb::object hot_free_py(Hot &self, nb::handle seq, nb::handle slot_, nb::handle epoch_,
                       nb::handle loose) {
    int slot = as_i(slot_);
    long long epoch = as_L(epoch_);
    WritableBuffer lv(loose, 4);
    HotCore *h = ready(self);
    if (!hot_free_ok(h, slot))
        return nb::none();
    LMap lm;
    open_map(h, lv, &lm);
    nb::object fast = fast_seq(seq, "ids must be a sequence");
    if (!fast.is_valid())
        throw_error();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    if (n == 0)
        return int_result(0);
    Ids<64> bs(n);
    if (!read_ids(h, fast.ptr(), bs.p, n))
        return nb::none();
    if (self.stash_n + n > (int64_t)self.stash.size() && n <= (int64_t)self.stash.size()) {
        Stash st = self.stash_view();
        stash_compact(h, slot, &st);
        self.stash_n = st.n;
    }
    if (self.stash_n + n <= (int64_t)self.stash.size()) {
        Stash st = self.stash_view();
        int64_t k = hot_stash_put(h, bs.p, n, slot, &st);
        self.stash_n = st.n;
        if (k == n)
            return int_result(n);
    }
    int64_t r = retried(self, [&] { return (int64_t)hot_free(h, bs.p, n, slot, epoch, &lm); });
    if (r == HOT_NOMEM)
        raise_no_memory();
    if (r < 0)
        return nb::none();
    return int_result(r);
}

// set_reserve(cap) -> the ids this process's reserve list drops (beyond
// cap, the oldest first): still in the slot's reserve, for the caller to
// take out under the lock (reserve.py).
nb::object hot_set_reserve_py(Hot &self, nb::handle cap_) {
    Py_ssize_t cap = as_n(cap_);
    if (cap < 0 || cap > (1 << 20))
        throw nb::value_error("a reserve holds 0 to 1048576 blocks");
    ready(self);
    int64_t drop = self.stash_n > cap ? self.stash_n - cap : 0;
    PyObject *list = PyList_New(drop);
    if (!list)
        throw_error();
    for (int64_t i = 0; i < drop; i++)
        PyList_SET_ITEM(list, i, PyLong_FromLong(self.stash[i]));
    for (int64_t i = drop; i < self.stash_n; i++)
        self.stash[i - drop] = self.stash[i];
    self.stash_n -= drop;
    self.stash.resize(cap);
    return nb::steal(list);
}

}  // namespace

NB_MODULE(_hot, m) {
    m.doc() = "The pool mutex and fused hot paths of shmcache, in C (nanobind binding).";
    // the names of Hot()'s parameters, in the order it takes them (this
    // build's hot_params_gen.h): layout.HOT_PARAM_NAMES when the build is current
    {
        nb::list names;
        for (int i = 0; i < P_COUNT; i++)
            names.append(nb::str(hot_param_names[i]));
        m.attr("PARAM_NAMES") = nb::tuple(names);
    }
    // Pools still open at exit hold their Hot objects: not leaks to report.
    nb::set_leak_warnings(false);

    nb::class_<Hot>(m, "Hot", "Hot(buffer, params, created_at): the pool mutex and fused operations.")
        .def("__init__", &hot_init, nb::arg("buf"), nb::arg("params"),
             nb::arg("created_at") = 0.0)
        .def("release", [](Hot &self) { self.release(); }, "Release the buffer (before unmapping).")
        .def("set_chunks", &hot_set_chunks_py,
             "set_chunks(nchunks): the pool's chunk count; turns the fused ops on.")
        .def("init_mutex", &hot_init_mutex_py, "Initialise the robust mutex (creator only).")
        .def("trylock", &hot_trylock_py, "0 locked, 1 locked after the holder died, -1 busy.")
        .def("lock", &hot_lock_py, nb::arg("give_up") = false,
             "Wait for the lock (GIL released); 1 if the holder died; with give_up, -2 "
             "(not locked) when the word named one live thread for a second.")
        .def("mark_owner_dead", [](Hot &self, uint32_t w) {
                 return hot_mark_owner_dead(ready(self)->mutex, w) != 0; },
             "mark_owner_dead(word) -> whether the lock word, still `word`, was marked "
             "owner-died (the next locker gets EOWNERDEAD and repairs).")
        .def("lock_word", [](Hot &self) {
                 return __atomic_load_n((uint32_t *)ready(self)->mutex, __ATOMIC_ACQUIRE); },
             "The mutex's lock word (glibc: owner tid | waiters | owner died).")
        .def("unlock", &hot_unlock_py, "Release the lock.")
        .def("lock_slices", [](Hot &) { return lock_slices_expired; },
             "Timed-lock slices this process let run out (a test hook).")
        .def("log_waits", [](Hot &self, bool on) { self.log_waits = on; },
             "log_waits(on): record how long each fused op's wait for the lock takes.")
        .def("log_holds", [](Hot &self, int level) {
                 HotCore *h = ready(self);
                 h->log_holds = level;
                 h->trace = NULL;
                 h->trace_n = 0;
                 self.trace.assign(level > 1 ? TRACE_WORDS << 20 : 0, 0);
                 h->trace = level > 1 ? self.trace.data() : NULL;
                 h->trace_cap = (int64_t)self.trace.size();
             },
             "log_holds(level): 1 times the fused ops' lock holds (take_holds); 2 also "
             "traces each hold (take_trace).")
        .def("trace_hold", [](Hot &self, int64_t asked, int64_t locked, int64_t released) {
                 trace_hold(ready(self), asked, asked, locked, released, 2);
             },
             "trace_hold(asked, locked, released): trace a hold of the Python path "
             "(CLOCK_MONOTONIC ns).")
        .def("take_trace", [](Hot &self) {
                 HotCore *h = ready(self);
                 std::vector<int64_t> r(self.trace.begin(), self.trace.begin() + h->trace_n);
                 h->trace_n = 0;
                 return r;
             },
             "The traced holds, (asked, turn, locked, released, kind) each, flat; emptied.")
        .def("take_holds", [](Hot &self) {
                 HotCore *h = ready(self);
                 std::pair<int64_t, int64_t> r(h->holds, h->held_ns);
                 h->holds = h->held_ns = 0;
                 return r;
             },
             "(holds, ns held) since the last call, while log_holds is on.")
        .def("take_waits", [](Hot &self) { std::vector<int64_t> w; w.swap(self.waits); return w; },
             "The recorded waits (ns), emptied.")
        .def("set_reserve", &hot_set_reserve_py,
             "set_reserve(cap) -> ids dropped from this process's reserve list (the caller "
             "takes them out of the reserve).")
        .def("unstash", [](Hot &self, nb::handle b_, nb::handle slot_) {
                 HotCore *h = ready(self);
                 Py_ssize_t b = as_n(b_);
                 return hot_is_block(h, b) && hot_unstash(h, (int32_t)b, as_i(slot_)) == 1;
             },
             "unstash(block, slot) -> whether it was taken out of slot's reserve (lock held "
             "by the caller, who then drops slot's reference).")
        .def("alloc", &hot_alloc_py, "alloc(n, slot, epoch, loose) -> ids or None.")
        .def("free", &hot_free_py, "free(ids, slot, epoch, loose) -> freed or None.")
        .def("table_new", &hot_table_new_py,
             "table_new(raw, hash, slot) -> table, or None (lock held by the caller).")
        .def("table_drop", &hot_table_drop_py,
             "table_drop(t) -> references released, or None (lock held by the caller).")
        .def("table_take", &hot_table_take_py,
             "table_take(t, ids, now, tokens) -> len(ids), or None (lock held by the caller).")
        .def("find_chain", &hot_find_chain_py,
             "find_chain(hashes) -> blocks of the longest cached run, or None (lock held by the caller).")
        .def("append", &hot_append_py,
             "append(t, rhash, n, bs, now, slot, epoch) -> ids the tokens land in, or None "
             "(takes the lock itself).")
        .def("add_counter", [](Hot &self, int i, int64_t n) {
                 HotCore *h = ready(self);
                 if (i >= 0 && i < 64)
                     __atomic_fetch_add(&h->c[i], n, __ATOMIC_RELAXED);
             },
             "add_counter(i, n): counter i += n, atomically (lock-free appends add to the "
             "token counter too).")
        .def("claim_table", &hot_claim_table_py,
             "claim_table(t) -> 0 taken, -1 this hold's already, else the holder (slot + 1) "
             "that kept it; None: t out of range or the lock not held here.")
        .def("unclaim_table", &hot_unclaim_table_py,
             "unclaim_table(t): give table t's claim back (lock held).")
        .def("table_ids", &hot_table_ids_py,
             "table_ids(t, rhash, slot, epoch) -> the ids of table t's list, or None (takes the "
             "lock itself).")
        .def("new_table", &hot_new_table_py,
             "new_table(raw, hash, slot, epoch) -> table, or None (takes the lock itself).")
        .def("delete_table", &hot_delete_table_py,
             "delete_table(raw, hash, slot, epoch) -> the table deleted, or None (takes the "
             "lock itself).")
        .def("acquire", &hot_acquire_py,
             "acquire(t, rhash, hashes, now, bs, slot, epoch) -> ids taken into table t, or None "
             "(takes the lock itself).")
        .def("add_block", &hot_add_block_py,
             "add_block(t, rhash, b, tokens, bs, now, slot, epoch) -> b's position in table t, "
             "appended with a new reference, or None (takes the lock itself).")
        .def("lookup", &hot_lookup_py,
             "lookup(hashes, now, slot, epoch) -> ids of the longest cached run, counted (and "
             "touched at now >= 0), or None (takes the lock itself).")
        .def("publish", &hot_publish_py,
             "publish(ids, hashes, bs, slot, epoch) -> blocks newly cached, or None (takes the "
             "lock itself).")
        .def("table_append", &hot_table_append_py,
             "table_append(t, n, bs, now) -> ids the tokens land in, or None (lock held by the caller).");

    m.attr("MUTEX_SIZE") = (long)sizeof(pthread_mutex_t);
}
