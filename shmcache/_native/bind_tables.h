// shmcache/_native/bind_tables.h: the binding side of shmcache._hot's table
// ops and prefix lookup (hot.cpp, the one unit that includes this, puts them
// in the module): table_new, table_drop, table_take, table_append and
// find_chain run inside a hold the Python caller took; new_table,
// delete_table, append, acquire, add_block, lookup, publish and table_ids
// (hot_fused.h) take the lock
// themselves. Each converts its arguments
// (bind_args.h), calls the core and turns HOT_SLOW into None.
#ifndef SHMCACHE_BIND_TABLES_H
#define SHMCACHE_BIND_TABLES_H

#include <nanobind/nanobind.h>

#include <cstdint>

#include "bind_args.h"
#include "hot_append.h"
#include "hot_fused.h"
#include "hot_index.h"
#include "hot_tables.h"

namespace hotbind {

// A count (or a table) from an op, or None when it refused (nothing
// changed); its lack of memory raised.
nb::object count_result(int64_t r) {
    if (r == HOT_NOMEM)
        raise_no_memory();
    if (r < 0)
        return nb::none();
    return int_result(r);
}

// A table op's result: the list of ids its accept built (build_list, before
// the op's first write), or None when it refused (nothing changed; a list
// built before a later refusal is dropped); the accept's MemoryError, or
// the op's lack of memory, raised.
nb::object list_result(int64_t r, PyObject *list) {
    if (r < 0)
        Py_XDECREF(list);
    if (r == HOT_REFUSED)
        throw_error();
    if (r == HOT_NOMEM)
        raise_no_memory();
    if (r < 0)
        return nb::none();
    return nb::steal(list);
}

// An append's result: op(out, span, &list) runs with room for the span
// of blocks the n tokens land in, sized before the lock from table t as it
// is (the op refuses when the span it finds under the lock does not fit).
template <class Op>
nb::object appended(HotCore *h, int64_t t, int64_t n, int64_t bs, Op op) {
    int64_t span = hot_table_append_span(h, t, n, bs);
    if (span < 0)
        return nb::none();
    Ids<64> out(span);
    PyObject *list = nullptr;
    int64_t r = op(out.p, span, &list);
    return list_result(r, list);
}

// table_new(raw, hash, slot) -> the new table, or None (nothing changed).
nb::object hot_table_new_py(Hot &self, nb::handle raw_, nb::handle hash_, nb::handle slot_) {
    Py_ssize_t n;
    const char *raw = as_y(raw_, 1, &n);
    uint64_t hash = as_K(hash_, 2);
    int slot = as_i(slot_);
    int64_t t = hot_table_new(ready(self), raw, n, hash, slot);
    return count_result(t);
}

// A table named by its request id, as new_table and delete_table take it:
// its key (raw bytes, 64-bit hash: refs.rid_key), the caller's slot and the
// epoch of its view.
struct RidArgs {
    Py_ssize_t n = 0;
    const char *raw;
    uint64_t hash;
    int slot;
    long long epoch;

    RidArgs(nb::handle raw_, nb::handle hash_, nb::handle slot_, nb::handle epoch_)
        : raw(as_y(raw_, 1, &n)), hash(as_K(hash_, 2)), slot(as_i(slot_)), epoch(as_L(epoch_)) {}
};

// new_table(raw, hash, slot, epoch) -> the new table, or None (nothing
// changed): table_new in a hold of its own (hot_new_table).
nb::object hot_new_table_py(Hot &self, nb::handle raw_, nb::handle hash_, nb::handle slot_,
                            nb::handle epoch_) {
    RidArgs a(raw_, hash_, slot_, epoch_);
    HotCore *h = ready(self);
    int64_t t = retried(self, [&] {
        return hot_new_table(h, a.raw, a.n, a.hash, a.slot, a.epoch);
    });
    return count_result(t);
}

// delete_table(raw, hash, slot, epoch) -> the table deleted, or None
// (nothing changed): its references released and its index entry removed
// in a hold of its own (hot_delete_table).
nb::object hot_delete_table_py(Hot &self, nb::handle raw_, nb::handle hash_, nb::handle slot_,
                               nb::handle epoch_) {
    RidArgs a(raw_, hash_, slot_, epoch_);
    HotCore *h = ready(self);
    int64_t t = -1;
    int64_t r = retried(self, [&] {
        return hot_delete_table(h, a.raw, a.n, a.hash, a.slot, a.epoch, &t);
    });
    return count_result(r < 0 ? r : t);
}

// table_drop(t) -> references released, or None (nothing changed).
nb::object hot_table_drop_py(Hot &self, nb::handle t_) {
    Py_ssize_t t = as_n(t_);
    int64_t r = hot_table_drop(ready(self), t);
    return count_result(r);
}

// table_take(t, ids, now, tokens) -> len(ids), or None (nothing changed).
nb::object hot_table_take_py(Hot &self, nb::handle t_, nb::handle seq, nb::handle now_,
                             nb::handle tokens_) {
    Py_ssize_t t = as_n(t_);
    double now = as_d(now_);
    Py_ssize_t tokens = as_n(tokens_);
    HotCore *h = ready(self);
    nb::object fast = fast_seq(seq, "ids must be a sequence");
    if (!fast.is_valid()) {
        // (a table op that would refuse anyway refuses before it reads ids)
        if (!hot_table_ops_on(h, t)) {
            PyErr_Clear();
            return nb::none();
        }
        throw_error();
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    if (n <= 0 || n >= h->p[P_MAX_BLOCKS])      // (before sizing anything by n)
        return nb::none();
    Ids<256> bs(n);
    if (!read_ids(h, fast.ptr(), bs.p, n))
        return nb::none();
    int64_t r = hot_table_take(h, t, bs.p, n, now, tokens);
    return count_result(r);
}

// table_append(t, n, bs, now) -> the ids of the blocks the n new tokens
// land in, or None (nothing changed).
nb::object hot_table_append_py(Hot &self, nb::handle t_, nb::handle n_, nb::handle bs_,
                               nb::handle now_) {
    Py_ssize_t t = as_n(t_), n = as_n(n_), bs = as_n(bs_);
    double now = as_d(now_);
    HotCore *h = ready(self);
    return appended(h, t, n, bs, [&](int32_t *out, int64_t span, PyObject **list) {
        return hot_table_append(h, t, n, bs, now, out, span, build_list, list);
    });
}

// append(t, rhash, n, bs, now, slot, epoch) -> the ids of the blocks the n
// new tokens land in, or None (nothing changed): table_append as a fused op
// that takes the lock itself (hot_append), for table t whose request id's
// hash is rhash.
nb::object hot_append_py(Hot &self, nb::handle t_, nb::handle rhash_, nb::handle n_,
                         nb::handle bs_, nb::handle now_, nb::handle slot_, nb::handle epoch_) {
    Py_ssize_t t = as_n(t_);
    uint64_t rhash = as_K(rhash_, 2);
    Py_ssize_t n = as_n(n_), bs = as_n(bs_);
    double now = as_d(now_);
    int slot = as_i(slot_);
    long long epoch = as_L(epoch_);
    HotCore *h = ready(self);
    // the tokens land in the table's private last block: no lock at all
    int64_t b = hot_append_free(h, t, rhash, n, bs, slot);
    if (b > 0) {
        PyObject *list = nullptr;
        int32_t id = (int32_t)b;
        build_list(&list, &id, 1);
        if (!list)
            throw_error();
        return nb::steal(list);
    }
    return appended(h, t, n, bs, [&](int32_t *out, int64_t span, PyObject **list) {
        return retried(self, [&] {
            return hot_append(h, t, rhash, n, bs, now, slot, epoch, out, span, build_list, list);
        });
    });
}

// claim_table(t) -> 0 (the lock holder has table t's claim now), -1 (it had
// it), or the claim's holder (slot + 1) that kept it (hot_claim.h); None
// when t is out of range or the lock is not held here.
nb::object hot_claim_table_py(Hot &self, nb::handle t_) {
    Py_ssize_t t = as_n(t_);
    HotCore *h = ready(self);
    if (h->p[P_MAX_TABLES] <= 0 || t < 0 || t >= h->p[P_MAX_TABLES] || !held_here(h))
        return nb::none();
    return int_result(hot_claim(h, t));
}

// unclaim_table(t): give table t's claim back, if the lock holder has it.
void hot_unclaim_table_py(Hot &self, nb::handle t_) {
    Py_ssize_t t = as_n(t_);
    HotCore *h = ready(self);
    if (h->p[P_MAX_TABLES] > 0 && t >= 0 && t < h->p[P_MAX_TABLES])
        hot_unclaim(h, t);
}

// table_ids(t, rhash, slot, epoch) -> the ids of table t's list, or None
// (the Python path reads them): under the table's claim without the lock
// (hot_table_ids_free), or else in a hold of its own (hot_table_ids),
// sized by the table's length read before the lock, and asked again once
// when the list grew meanwhile.
nb::object hot_table_ids_py(Hot &self, nb::handle t_, nb::handle rhash_, nb::handle slot_,
                            nb::handle epoch_) {
    Py_ssize_t t = as_n(t_);
    uint64_t rhash = as_K(rhash_, 2);
    int slot = as_i(slot_);
    long long epoch = as_L(epoch_);
    HotCore *h = ready(self);
    if (h->p[P_MAX_TABLES] <= 0 || t < 0 || t >= h->p[P_MAX_TABLES])
        return nb::none();
    int64_t room = TF(h, t, P_T_LEN);
    for (int k = 0; k < 2; k++) {
        if (room < 0 || room > NCHUNKS(h) * CI)
            return nb::none();
        Ids<256> out(room);
        // without the lock, under the table's claim; else in a hold
        int64_t r = hot_table_ids_free(h, t, rhash, slot, out.p, room);
        if (r == HOT_SLOW)
            r = retried(self, [&] {
                return hot_table_ids(h, t, rhash, slot, epoch, out.p, room);
            });
        if (r < 0)
            return nb::none();
        if (r <= room) {
            PyObject *list = nullptr;
            build_list(&list, out.p, r);
            if (!list)
                throw_error();
            return nb::steal(list);
        }
        room = r;
    }
    return nb::none();
}

// acquire(t, rhash, hashes, now, bs, slot, epoch) -> the ids of the blocks
// of the longest cached run of hashes (16 bytes each, concatenated), taken
// into table t, or None (nothing changed): find_chain and table_take in a
// hold of their own (hot_acquire).
nb::object hot_acquire_py(Hot &self, nb::handle t_, nb::handle rhash_, nb::handle hashes_,
                          nb::handle now_, nb::handle bs_, nb::handle slot_,
                          nb::handle epoch_) {
    Py_ssize_t t = as_n(t_), len;
    uint64_t rhash = as_K(rhash_, 2);
    const char *hashes = as_y(hashes_, 3, &len);
    double now = as_d(now_);
    Py_ssize_t bs = as_n(bs_);
    int slot = as_i(slot_);
    long long epoch = as_L(epoch_);
    HotCore *h = ready(self);
    if (len % 16 || len / 16 >= h->p[P_MAX_BLOCKS])    // (before sizing anything by it)
        return nb::none();
    Py_ssize_t nh = len / 16;
    Ids<64> out(nh ? nh : 1);
    PyObject *list = nullptr;
    const unsigned char *hs = (const unsigned char *)hashes;
    int64_t r = retried(self, [&] {
        return (int64_t)hot_acquire(h, t, rhash, hs, nh, now, bs, slot, epoch, out.p, build_list,
                                    &list);
    });
    return list_result(r, list);
}

// add_block(t, rhash, b, tokens, bs, now, slot, epoch) -> the position of
// block b, appended to table t with a new reference (tokens counted), or
// None (nothing changed): hot_add_block, in a hold of its own.
nb::object hot_add_block_py(Hot &self, nb::handle t_, nb::handle rhash_, nb::handle b_,
                            nb::handle tokens_, nb::handle bs_, nb::handle now_,
                            nb::handle slot_, nb::handle epoch_) {
    Py_ssize_t t = as_n(t_);
    uint64_t rhash = as_K(rhash_, 2);
    Py_ssize_t b = as_n(b_), tokens = as_n(tokens_), bs = as_n(bs_);
    double now = as_d(now_);
    int slot = as_i(slot_);
    long long epoch = as_L(epoch_);
    HotCore *h = ready(self);
    int64_t r = retried(self, [&] {
        return (int64_t)hot_add_block(h, t, rhash, b, tokens, bs, now, slot, epoch);
    });
    return count_result(r);
}

// lookup(hashes, now, slot, epoch) -> the ids of the blocks of the longest
// cached run of hashes (16 bytes each, concatenated), counted as hits (and
// the miss that ended it), their last access set to now where now >= 0, or
// None (nothing changed): hot_lookup, in a hold of its own; no reference
// is taken.
nb::object hot_lookup_py(Hot &self, nb::handle hashes_, nb::handle now_, nb::handle slot_,
                         nb::handle epoch_) {
    Py_ssize_t len;
    const char *hashes = as_y(hashes_, 0, &len);
    double now = as_d(now_);
    int slot = as_i(slot_);
    long long epoch = as_L(epoch_);
    HotCore *h = ready(self);
    if (len % 16 || len / 16 >= h->p[P_MAX_BLOCKS])    // (before sizing anything by it)
        return nb::none();
    Py_ssize_t nh = len / 16;
    Ids<64> out(nh ? nh : 1);
    const unsigned char *hs = (const unsigned char *)hashes;
    int64_t r = retried(self, [&] {
        return (int64_t)hot_lookup(h, hs, nh, now, slot, epoch, out.p);
    });
    if (r < 0)
        return nb::none();
    PyObject *list = nullptr;
    build_list(&list, out.p, r);
    if (!list)
        throw_error();
    return nb::steal(list);
}

// publish(ids, hashes, bs, slot, epoch) -> how many blocks of ids became
// cached, or None (nothing changed, or the index is corrupted and the pool
// left dirty): each uncached block of ids cached under its hash (16 bytes
// each, concatenated, one per id) and counted full (bs tokens), in a hold
// of its own (hot_publish).
nb::object hot_publish_py(Hot &self, nb::handle seq, nb::handle hashes_, nb::handle bs_,
                          nb::handle slot_, nb::handle epoch_) {
    Py_ssize_t len;
    const char *hashes = as_y(hashes_, 2, &len);
    Py_ssize_t bs = as_n(bs_);
    int slot = as_i(slot_);
    long long epoch = as_L(epoch_);
    HotCore *h = ready(self);
    if (!hot_index_on(h))
        return nb::none();
    nb::object fast = fast_seq(seq, "ids must be a sequence");
    if (!fast.is_valid())
        throw_error();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    if (n >= h->p[P_MAX_BLOCKS] || len != 16 * n)      // (before sizing anything by n)
        return nb::none();
    Ids<64> ids(n ? n : 1);
    if (!read_ids(h, fast.ptr(), ids.p, n))
        return nb::none();
    const unsigned char *hs = (const unsigned char *)hashes;
    int64_t r = retried(self, [&] {
        return hot_publish(h, ids.p, n, hs, bs, slot, epoch);
    });
    return count_result(r);
}

// find_chain(hashes) -> the blocks of the longest cached run of hashes
// from the first, or None (a probe met an entry out of range or went all
// the way round: the Python path meets the same and raises). Each hash is
// 16 bytes (else None).
nb::object hot_find_chain_py(Hot &self, nb::handle seq) {
    HotCore *h = ready(self);
    if (!hot_index_on(h))
        return nb::none();
    nb::object fast = fast_seq(seq, "hashes must be a sequence");
    if (!fast.is_valid())
        throw_error();
    nb::object out = nb::steal(PyList_New(0));
    if (!out.is_valid())
        throw_error();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast.ptr(), i);
        if (!PyBytes_CheckExact(o) || PyBytes_GET_SIZE(o) != 16)
            return nb::none();
        int64_t e = hot_index_find(h, (const unsigned char *)PyBytes_AS_STRING(o));
        if (e < 0)
            return nb::none();
        if (e == 0)
            break;
        PyObject *bo = PyLong_FromLong((long)e);
        if (!bo)
            throw_error();
        int failed = PyList_Append(out.ptr(), bo);
        Py_DECREF(bo);
        if (failed)
            throw_error();
    }
    return out;
}

}  // namespace hotbind

#endif
