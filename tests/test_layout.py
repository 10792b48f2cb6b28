"""The byte map (shmcache/shm/layout.py): sections aligned, in order and not
overlapping for many parameter sets; the record types' sizes; the counter
indices; the default capacities; and the header check that refuses every
parameter or size a pool of this version could not have written."""

from __future__ import annotations

import numpy as np
import pytest

from shmcache.shm import layout as L
from shmcache.errors import CorruptPoolError

# block_size, max_blocks, caching, layers, kv_heads, head_dim, dtype, slots, tables, refs
PARAMS = [
    (4, 32, True, 1, 1, 8, "float16", 64, 32, L.default_max_refs(32, 32)),
    (1, 2, False, 0, 1, 1, "float32", 1, 1, 1),                  # the smallest pool
    (16, 1000, True, 2, 2, 64, "bfloat16", 3, 17, 5),
    (64, 4096, True, 32, 8, 128, "float16", 1024, 4096, L.default_max_refs(4096, 4096)),
    (65535, 7, True, 1, 3, 5, "float32", 5, 9, 123),             # odd sizes everywhere
]


def _lay(params) -> L.Layout:
    return L.compute_layout(*params)


def _sections(lay) -> list:
    """(name, offset, size) of every section, in file order."""
    return [("header", 0, L.HEADER_SIZE),
            ("counters", lay.counters_off, L.COUNTERS_SIZE),
            ("slots", lay.slots_off, lay.max_slots * L.SLOT_DTYPE.itemsize),
            ("blocks", lay.blocks_off, (lay.max_blocks + 2) * L.BLOCK_DTYPE.itemsize),
            ("prefix index", lay.hash_off, lay.hash_capacity * 4),
            ("chunks", lay.refs_off, lay.num_chunks * L.CHUNK_DTYPE.itemsize),
            ("tables", lay.tables_off, lay.max_tables * L.TABLE_DTYPE.itemsize),
            ("request-id index", lay.tindex_off, lay.table_capacity * 4),
            ("arena", lay.arena_off, lay.arena_size)]


# ====================================================================== sections
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"bs{p[0]}-n{p[1]}-{p[6]}")
def test_sections_are_aligned_in_order_and_do_not_overlap(params):
    lay = _lay(params)
    end = 0
    for name, off, size in _sections(lay):
        assert off % 64 == 0, name
        assert off >= end, f"{name} overlaps the section before it"
        end = off + size
    assert lay.arena_off % 4096 == 0 and lay.total_size % 4096 == 0
    assert end <= lay.total_size < end + 4096
    assert lay.metadata_size == lay.arena_off


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"bs{p[0]}-n{p[1]}-{p[6]}")
def test_layout_records_its_parameters_and_derived_sizes(params):
    lay = _lay(params)
    bs, n, caching, layers, heads, dim, dtype, slots, tables, refs = params
    assert (lay.block_size, lay.max_blocks, lay.enable_caching) == (bs, n, caching)
    assert (lay.max_slots, lay.max_tables, lay.max_refs) == (slots, tables, refs)
    assert lay.num_chunks == L.num_chunks(refs, tables, slots)
    assert lay.arena_shape == (layers, n, 2, heads, bs, dim)
    assert lay.arena_size == int(np.prod(lay.arena_shape)) * L.ITEMSIZE[dtype]
    # one block's K and V of every layer: the arena's slice at one block index
    assert lay.block_bytes == layers * 2 * heads * bs * dim * L.ITEMSIZE[dtype]
    assert lay.arena_size == n * lay.block_bytes
    for cap, least in ((lay.hash_capacity, 2 * n), (lay.table_capacity, 2 * tables)):
        assert cap >= max(least, 16) and cap & (cap - 1) == 0
        assert cap < 2 * max(least, 16)            # the smallest power of two that fits


def test_pool_indexes_are_at_most_half_full():
    """The probing in shmcache/shm/index.py relies on it (a probe ends at an empty slot)."""
    for n in (2, 3, 100, 1000):
        lay = L.compute_layout(4, n, True, 1, 1, 8, "float16", 4, n, 2 * n)
        assert lay.hash_capacity >= 2 * n and lay.table_capacity >= 2 * n
        assert lay.hash_capacity & (lay.hash_capacity - 1) == 0


def test_the_header_page_holds_the_record_mutex_liveness_and_creation_byte():
    assert L.HEADER_DTYPE.itemsize <= L.MUTEX_OFF
    assert L.MUTEX_OFF + L.MUTEX_BYTES <= L.LIVENESS_OFF
    assert L.LIVENESS_OFF + L.MAX_SLOTS_LIMIT <= L.INIT_LOCK_OFF < L.HEADER_SIZE
    assert L.PARAM_RANGES["max_slots"][1] == L.MAX_SLOTS_LIMIT     # a liveness byte each


def test_a_bigger_parameter_never_shrinks_the_segment():
    base = list(PARAMS[0])
    size = _lay(base).total_size
    for i in (0, 1, 3, 4, 5, 7, 8, 9):
        bigger = list(base)
        bigger[i] = bigger[i] * 2 + 1
        assert _lay(bigger).total_size >= size, i
    assert _lay(base[:6] + ["float32"] + base[7:]).arena_size == 2 * _lay(base).arena_size


# ====================================================================== record types
def test_record_types_have_the_documented_sizes():
    assert (L.SLOT_DTYPE.itemsize, L.BLOCK_DTYPE.itemsize, L.CHUNK_DTYPE.itemsize,
            L.TABLE_DTYPE.itemsize) == (64, 40, 64, 128)
    assert L.COUNTERS_SIZE == 8 * L.NUM_COUNTERS
    assert L.BLOCK_DTYPE.fields["hash"][1] == L.BLOCK_HASH_OFF
    assert L.BLOCK_DTYPE.fields["hash"][0].itemsize == L.HASH_BYTES == 16
    assert L.CHUNK_DTYPE.itemsize == 4 * L.CHUNK_WORDS == 4 * (L.CHUNK_IDS + 1)
    assert L.CHUNK_DTYPE.fields["next"][1] == 0           # the link, then the ids
    assert L.TABLE_DTYPE.fields["request_id"][0].itemsize == L.RID_BYTES
    assert L.HEADER_DTYPE.names[-1] == "checksum"


def test_every_integer_field_is_little_endian():
    for dt in (L.HEADER_DTYPE, L.SLOT_DTYPE, L.BLOCK_DTYPE, L.CHUNK_DTYPE, L.TABLE_DTYPE):
        for name in dt.names:
            f = dt.fields[name][0]
            base = f.base if f.subdtype else f
            if base.kind in "iuf":
                assert base.byteorder in ("<", "=") and base.str[0] == "<", (dt, name)


def test_dtype_codes_round_trip():
    assert set(L.DTYPES) == set(L.ITEMSIZE)
    assert all(L.DTYPE_NAMES[code] == name for name, code in L.DTYPES.items())
    assert 0 not in L.DTYPE_NAMES                    # a zeroed header names no dtype


def test_one_kv_dtype_table_agrees_with_numpy_and_mlx():
    import mlx.core as mx
    for name, d in L.KV_DTYPES.items():
        assert d.name == name and d.np_dtype.itemsize == d.itemsize == L.ITEMSIZE[name]
        assert getattr(mx, name).size == d.itemsize            # the type a model hands us
        assert getattr(mx, d.np_dtype.name).size == d.itemsize  # the type it is stored as
    assert L.KV_DTYPES["bfloat16"].np_dtype == np.dtype("<u2")  # numpy has no bfloat16


# ====================================================================== counters
def _counter_names() -> dict:
    aliases = {"C_FREE_CHUNK", "C_FREE_CHUNKS"}     # other names of C_FREE_REF(S)
    return {k: v for k, v in vars(L).items()
            if k.startswith("C_") and isinstance(v, int) and k not in aliases}


def test_counter_indices_are_unique_and_in_range():
    named = _counter_names()
    assert len(named) >= 16
    indices = list(named.values()) + list(L.C_L2.values())
    assert len(set(indices)) == len(indices)
    assert all(0 <= i < L.NUM_COUNTERS for i in indices)
    assert L.C_FREE_CHUNK == L.C_FREE_REF and L.C_FREE_CHUNKS == L.C_FREE_REFS


def test_l2_counter_names_map_to_16_through_26():
    assert list(L.C_L2) == list(L.L2_COUNTERS)
    assert list(L.C_L2.values()) == list(range(16, 27))
    assert set(_counter_names().values()).isdisjoint(range(16, 27))


# ====================================================================== capacities
@pytest.mark.parametrize("blocks, tables, want", [
    (32, 16, 2 * 32 + 16 * 32),            # a table's share is at most the pool's blocks
    (1000, 64, 2 * 1000 + 64 * 256),       # 256 blocks per table on top
    (2, 1, 2 * 2 + 2),
    (L.MAX_BLOCKS_LIMIT, L.MAX_TABLES_LIMIT, L.MAX_REFS_LIMIT)])   # capped
def test_default_max_refs(blocks, tables, want):
    assert L.default_max_refs(blocks, tables) == want


def test_num_chunks_pays_for_every_lists_partial_chunk():
    assert L.num_chunks(15, 1, 1) == 1 + 2
    assert L.num_chunks(16, 1, 1) == 2 + 2
    assert L.num_chunks(1, 10, 3) == 1 + 13


# ====================================================================== header check
def _header(params) -> np.ndarray:
    """A header record as Pool.create writes it for ``params``."""
    lay = _lay(params)
    h = np.zeros(1, L.HEADER_DTYPE)
    h["magic"], h["version"], h["ready"] = L.MAGIC, L.LAYOUT_VERSION, 1
    for k in ("block_size", "max_blocks", "num_layers", "num_kv_heads", "head_dim",
              "max_slots", "max_tables", "max_refs", "hash_capacity", "table_capacity",
              "total_size"):
        h[k] = getattr(lay, k)
    h["enable_caching"] = int(lay.enable_caching)
    h["dtype_code"] = L.DTYPES[lay.dtype]
    h["checksum"] = np.frombuffer(L.header_checksum(h), "V16")
    return h[0]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"bs{p[0]}-n{p[1]}-{p[6]}")
def test_a_good_header_gives_back_its_layout(params):
    h = _header(params)
    assert L.layout_from_header(h) == _lay(params)
    assert L.layout_from_header(h, file_size=_lay(params).total_size) == _lay(params)


def test_the_checksum_ignores_only_ready_and_itself():
    h = _header(PARAMS[0])
    c = L.header_checksum(h)
    h["ready"] = 0
    assert L.header_checksum(h) == c
    h["creator_pid"] += 1
    assert L.header_checksum(h) != c


def _rechecksummed(h, **fields):
    h = h.copy()
    for k, v in fields.items():
        h[k] = v
    h["checksum"] = np.frombuffer(L.header_checksum(h), "V16")[0]
    return h


@pytest.mark.parametrize("field, value, words", [
    *[(k, lo - 1, k) for k, (lo, hi) in L.PARAM_RANGES.items()],
    *[(k, hi + 1, k) for k, (lo, hi) in L.PARAM_RANGES.items() if hi < 2**31 - 1],
    ("dtype_code", 0, "dtype"), ("dtype_code", 9, "dtype"),
    ("enable_caching", 2, "enable_caching"),
    ("hash_capacity", 1 << 20, "hash_capacity"),
    ("table_capacity", 16, "table_capacity"),
    ("total_size", 4096, "total_size")])
def test_a_header_with_a_bad_parameter_is_refused(field, value, words):
    params = (4, 32, True, 1, 1, 8, "float16", 64, 32, 2112)
    h = _rechecksummed(_header(params), **{field: value})
    with pytest.raises(CorruptPoolError, match=words):
        L.layout_from_header(h, where="pool x")
    with pytest.raises(CorruptPoolError, match="pool x"):
        L.layout_from_header(h, where="pool x")


def test_a_header_with_a_flipped_byte_or_of_another_size_is_refused():
    h = _header(PARAMS[0])
    size = _lay(PARAMS[0]).total_size
    with pytest.raises(CorruptPoolError, match="the file is"):
        L.layout_from_header(h, file_size=size + 4096)
    flipped = h.copy()
    flipped["created_at"] = 1.5                      # a field no other check covers
    with pytest.raises(CorruptPoolError, match="checksum"):
        L.layout_from_header(flipped)
