"""Byte map of a shmcache pool segment.

A pool is one file in /dev/shm (``shmcache.<name>``), mapped by every process
that attaches. Every offset below is computed from the header's parameters by
:func:`compute_layout`, so a reader of the header finds every section. All
integers are little-endian; every section starts on a 64-byte boundary.

    offset            size                      section
    ----------------  ------------------------  ------------------------------
    0                 HEADER_SIZE (4096)        header: HEADER_DTYPE (one record)
    4096              COUNTERS_SIZE (512)       counters: int64[64], see C_*
    4608              max_slots * 64            slots: SLOT_DTYPE, one per
                                                attached manager
    slots_off+...     (max_blocks + 2) * 40     blocks: BLOCK_DTYPE; records
                                                max_blocks and max_blocks + 1
                                                are the free list's head and
                                                tail sentinels
    hash_off          hash_capacity * 4         prefix index: int32 block_id
                                                per slot, -1 empty (linear
                                                probing, power-of-2 capacity)
    refs_off          num_chunks * 64           reference chunks: CHUNK_DTYPE,
                                                each a link (int32 chunk id, -1
                                                none) and CHUNK_IDS int32 block
                                                ids; every block table and every
                                                slot's loose references is a
                                                chain of them (see ``refs``)
    tables_off        max_tables * 128          block tables: TABLE_DTYPE
    tindex_off        table_capacity * 4        request-id index: int32 table
                                                index per slot, -1 empty
    arena_off         num_layers * 2 * num_kv_heads * max_blocks
                        * block_size * head_dim * itemsize
                                                KV payload, shaped
                                                (L, max_blocks, 2, H, T, D):
                                                one block's K and V of all
                                                heads in one layer are one
                                                contiguous run

Inside the header page:

    offset            size                      field
    ----------------  ------------------------  ------------------------------
    0                 HEADER_DTYPE.itemsize     the header record
    MUTEX_OFF (1024)  MUTEX_BYTES (64)          the pool lock: a process-shared
                                                robust pthread_mutex_t (40 B on
                                                x86-64 glibc), see ``platform``
    LIVENESS_OFF      MAX_SLOTS_LIMIT (1024)    liveness bytes, never written
      (2048)
    INIT_LOCK_OFF     1                         creation byte, never written
      (3072)

Byte ranges [LIVENESS_OFF + slot] of the file carry each attached manager's
OFD lock: the kernel drops it when the holder's open file description goes,
so "can I lock that byte?" answers "is the holder gone?". The creator holds
an OFD lock on byte INIT_LOCK_OFF from before the file has a name (it is
made with O_TMPFILE) until the header is ready, so an attacher that finds a
header not ready waits while that byte is held and knows the creator died
when it is not.

Capacity: ``max_refs`` is how many block references the tables and loose
lists can hold together, however they are spread over them: there are
``ceil(max_refs / CHUNK_IDS) + max_tables + max_slots`` chunks
(:func:`num_chunks`), so every list's partly filled last chunk is paid for.
A reference costs 4 bytes (plus its share of a chunk's link); the pool
default is ``2 * max_blocks + max_tables * min(256, max_blocks)``.

The header record ends with ``checksum``: blake2b-128 of the record with
``ready`` and ``checksum`` zeroed, written before ``ready``. ``attach``
refuses a header whose checksum, sizes or offsets do not agree with each
other, with this layout version and with the file's size
(:func:`layout_from_header`), so a flipped header byte is an error at attach
and never a misread layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from hashlib import blake2b
from operator import attrgetter

import numpy as np

from ..errors import CorruptPoolError

MAGIC = b"SHMCACH1"
LAYOUT_VERSION = 8
HEADER_SIZE = 4096
COUNTERS_SIZE = 512
MUTEX_OFF = 1024             # inside the header, past HEADER_DTYPE
MUTEX_BYTES = 64
LIVENESS_OFF = 2048          # inside the header, past HEADER_DTYPE
MAX_SLOTS_LIMIT = 1024        # liveness bytes must fit in the header
INIT_LOCK_OFF = LIVENESS_OFF + MAX_SLOTS_LIMIT   # held by the creator until ready
MAX_BLOCKS_LIMIT = 2**31 - 3  # block ids, HEAD and TAIL are int32
MAX_TABLES_LIMIT = 2**24
MAX_REFS_LIMIT = 2**31 - 1    # chunk ids are int32, -1 is "none"
RID_BYTES = 64


@dataclass(frozen=True)
class KVDtype:
    """One element type the KV arena can hold.

    name: what a pool's ``dtype`` parameter says (an MLX dtype's name);
    code: the header's ``dtype_code`` (never 0, so a zeroed header names none);
    itemsize: bytes per element;
    storage: the numpy dtype the arena is viewed as (bfloat16, which numpy
    lacks, as its raw 16 bits: ``<u2``); MLX uses the same storage type.
    """
    name: str
    code: int
    itemsize: int
    storage: str

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.storage)


# The one table of KV element types: every other module derives its view
# (MLX dtypes, numpy dtypes, sizes, header codes) from it.
KV_DTYPES = {d.name: d for d in (KVDtype("float16", 1, 2, "<f2"),
                                 KVDtype("bfloat16", 2, 2, "<u2"),
                                 KVDtype("float32", 3, 4, "<f4"))}
DTYPES = {d.name: d.code for d in KV_DTYPES.values()}          # name -> header code
DTYPE_NAMES = {d.code: d.name for d in KV_DTYPES.values()}     # header code -> name
ITEMSIZE = {d.name: d.itemsize for d in KV_DTYPES.values()}    # name -> bytes


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                   dtype: str) -> int:
    """Bytes of one block's K and V across all layers (the one definition;
    :attr:`Layout.block_bytes` for a pool)."""
    return num_layers * 2 * num_kv_heads * block_size * head_dim * KV_DTYPES[dtype].itemsize


HEADER_DTYPE = np.dtype([
    ("magic", "S8"),
    ("version", "<u4"),
    ("ready", "<u4"),
    ("block_size", "<i4"),
    ("max_blocks", "<i4"),
    ("enable_caching", "<i4"),
    ("num_layers", "<i4"),
    ("num_kv_heads", "<i4"),
    ("head_dim", "<i4"),
    ("dtype_code", "<i4"),
    ("max_slots", "<i4"),
    ("max_tables", "<i4"),
    ("max_refs", "<i4"),
    ("hash_capacity", "<i4"),
    ("table_capacity", "<i4"),
    ("creator_pid", "<i8"),
    ("creator_start", "<f8"),
    ("created_at", "<f8"),
    ("seed", "V16"),
    ("total_size", "<i8"),
    ("checksum", "V16"),      # blake2b-128 of this record, ready and checksum zeroed
])

# Counter slots (int64). Derived ones are rebuilt by recovery.
C_DIRTY = 0            # 1 while a holder of the lock is mutating
C_NUM_FREE = 1         # blocks in the free list
C_FREE_REF = 2         # head of the free chunk list, -1 if none
C_HITS = 3
C_MISSES = 4
C_COW = 5
C_EVICTIONS = 6
C_RECOVERIES = 7       # times a dirty pool was repaired
C_RECLAIMED = 8        # references released from dead holders, all time
C_LOCK_WAIT_NS = 9     # longest wait for the pool lock seen
C_NUM_TABLES = 10
C_OPS = 11             # lock holds that ended cleanly
C_FREE_REFS = 12       # free chunks
C_EPOCH = 13           # bumped when lists move under live managers (repair, clear)
C_HOLDER = 14          # slot of the lock's holder (-1: none, or not attached yet)
C_TOKENS = 15          # the seed's total_tokens_cached: tokens added by
                       # add_block_to_table, less a block's token_count when
                       # it goes back to the free queue (a running count)
# The L2 tier's counters (shmcache.l2), summed over every process of the
# pool: each process adds its deltas under the pool lock now and then.
L2_COUNTERS = ("lookups", "hits", "misses", "read_bytes", "writes", "written_bytes",
               "dropped", "rejected", "timeouts", "errors", "outages")
C_L2 = {name: 16 + i for i, name in enumerate(L2_COUNTERS)}   # counters 16..26
C_FREE_CHUNK, C_FREE_CHUNKS = C_FREE_REF, C_FREE_REFS
# The turns of the fused C ops at the pool lock (shmcache/_native/hot_enter.h,
# take_turn): the next turn to hand out, and the turn whose holder may take
# the lock now. Each on a cache line of its own (the waiters poll C_TURN_NOW).
C_TURN_NEXT = 32
C_TURN_NOW = 40
# Processes attached without the C accelerator (slots with ``pure`` set): while
# any is, no append runs without the pool lock (a pure process cannot
# compare-and-swap a table's claim). Derived: recovery recounts it.
C_PURE = 48
NUM_COUNTERS = 64
# The counters by name (``counters.Counters`` has a property for each): every
# ``C_*`` word above, named by its constant in lower case (C_NUM_FREE:
# num_free); built from the constants, not kept a second time. The L2 tier's
# are C_L2's; C_FREE_CHUNK(S) are other names of C_FREE_REF(S).
COUNTER_WORDS = {k[2:].lower(): v for k, v in list(globals().items())
                 if k.startswith("C_") and type(v) is int
                 and k not in ("C_FREE_CHUNK", "C_FREE_CHUNKS")}

SLOT_DTYPE = np.dtype([
    ("pid", "<i8"),
    ("start_time", "<f8"),
    ("attached_at", "<f8"),
    ("state", "<i4"),       # 0 free, 1 active
    ("loose_head", "<i4"),  # first chunk of this slot's loose references (-1: none)
    ("loose_count", "<i4"), # loose references held
    ("reserved", "<i4"),    # of them, blocks in this slot's reserve (see STASH_MARK)
    ("pure", "<i4"),        # 1: attached without the C accelerator (counted in C_PURE)
    ("_pad", "V20"),
])

BLOCK_DTYPE = np.dtype([
    ("ref_count", "<i4"),
    ("prev", "<i4"),
    ("next", "<i4"),
    ("flags", "<u2"),
    ("token_count", "<u2"),
    ("last_access", "<f4"),   # seconds since the pool's created_at
    ("hash", "V16"),          # chain hash, valid when FLAG_CACHED
    ("gen", "<u4"),           # bumped each time the block is taken for reuse
])
BLOCK_HASH_OFF = 20           # byte offset of "hash" inside a record
HASH_BYTES = 16
FLAG_NULL = 1
FLAG_CACHED = 2


def stash_mark(slot: int) -> int:
    """The ``prev`` of a block in ``slot``'s reserve (see below)."""
    return -2 - slot


def held_mark(slot: int, max_slots: int) -> int:
    """The ``prev`` of a block allocated as a loose reference of ``slot``."""
    return -2 - max_slots - slot


def mark_slot(prev: int, max_slots: int):
    """(slot, stashed) of a ``prev`` that is a mark, else None."""
    if -2 - max_slots < prev <= -2:
        return -2 - prev, True
    if -2 - 2 * max_slots < prev <= -2 - max_slots:
        return -2 - max_slots - prev, False
    return None

# A block's ``prev`` is a free-list link while it is free, and otherwise -1
# or one of two marks of the slot s that holds it as a loose reference:
#   held_mark(s) = -2 - max_slots - s: allocated as a loose reference of s,
#       which still holds one (cleared when s drops its last);
#   stash_mark(s) = -2 - s: in s's reserve: free to every reader (it counts
#       in the slot's ``reserved`` and as a free block), but still held loose
#       by s, whose next allocation takes it back without the pool lock.
# Only the owner turns held into stash and back, and anyone who takes a
# block out of a reserve turns stash into -1, each by compare-and-swap (the
# owner does it without the pool lock; see docs/design.md, "Reserves").
CHUNK_IDS = 15                # block ids per chunk
CHUNK_WORDS = CHUNK_IDS + 1   # int32 words per chunk: the link, then the ids
CHUNK_DTYPE = np.dtype([
    ("next", "<i4"),                         # next chunk of the list (or of the free list)
    ("block_id", "<i4", (CHUNK_IDS,)),       # block ids; [0] is -1 in a free chunk
])

TABLE_DTYPE = np.dtype([
    ("request_id", f"S{RID_BYTES}"),
    ("rid_hash", "<u8"),
    ("state", "<i4"),      # 0 free, 1 live (written last on create)
    ("owner", "<i4"),      # slot that owns (and on death releases) it
    ("head", "<i4"),       # first chunk (-1: empty)
    ("tail", "<i4"),       # last chunk, partly filled (-1: empty)
    ("length", "<i4"),     # block ids in the table (its commit point)
    ("num_tokens", "<i4"),
    ("claim", "<i4"),      # who may write the table now (see below)
    ("_pad", "V28"),
])
# A table's ``claim``: 0, nobody; -1, the pool lock's holder (taken, by
# compare-and-swap from 0, before a hold writes the table, and given back
# before the hold ends); s + 1, slot s without the pool lock: the table's
# owner appending into the table's last block, or any slot reading its block
# ids (shmcache/_native/hot_claim.h).
# See docs/design.md, "Lock-free appends".

for _dt, _size in ((SLOT_DTYPE, 64), (BLOCK_DTYPE, 40), (CHUNK_DTYPE, 64), (TABLE_DTYPE, 128)):
    assert _dt.itemsize == _size, (_dt, _dt.itemsize)
assert HEADER_DTYPE.itemsize <= MUTEX_OFF and MUTEX_OFF + MUTEX_BYTES <= LIVENESS_OFF
assert INIT_LOCK_OFF < HEADER_SIZE


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def num_chunks(max_refs: int, max_tables: int, max_slots: int) -> int:
    """Chunks of a pool: enough for ``max_refs`` references in any spread
    over ``max_tables`` tables and ``max_slots`` loose lists."""
    return -(-max_refs // CHUNK_IDS) + max_tables + max_slots


def default_max_refs(max_blocks: int, max_tables: int) -> int:
    """References a pool holds by default: every block twice, and 256
    blocks (4,096 tokens of 16) per table on top (but no more per table
    than the pool has blocks)."""
    return min(MAX_REFS_LIMIT, 2 * max_blocks + max_tables * min(256, max_blocks))


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


@dataclass(frozen=True)
class Layout:
    block_size: int
    max_blocks: int
    enable_caching: bool
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_slots: int
    max_tables: int
    max_refs: int
    num_chunks: int
    hash_capacity: int
    table_capacity: int
    counters_off: int
    slots_off: int
    blocks_off: int
    hash_off: int
    refs_off: int
    tables_off: int
    tindex_off: int
    arena_off: int
    arena_size: int
    total_size: int

    @property
    def metadata_size(self) -> int:
        return self.arena_off

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K and V across all layers (the arena holds
        ``max_blocks`` of them)."""
        return kv_block_bytes(self.num_layers, self.num_kv_heads, self.head_dim,
                              self.block_size, self.dtype)

    @property
    def arena_shape(self) -> tuple:
        return (self.num_layers, self.max_blocks, 2, self.num_kv_heads,
                self.block_size, self.head_dim)


def compute_layout(block_size: int, max_blocks: int, enable_caching: bool,
                   num_layers: int, num_kv_heads: int, head_dim: int,
                   dtype: str, max_slots: int, max_tables: int,
                   max_refs: int) -> Layout:
    hash_capacity = _pow2_at_least(max(2 * max_blocks, 16))
    table_capacity = _pow2_at_least(max(2 * max_tables, 16))
    counters_off = HEADER_SIZE
    slots_off = counters_off + COUNTERS_SIZE
    blocks_off = _align(slots_off + max_slots * SLOT_DTYPE.itemsize)
    hash_off = _align(blocks_off + (max_blocks + 2) * BLOCK_DTYPE.itemsize)
    refs_off = _align(hash_off + hash_capacity * 4)
    chunks = num_chunks(max_refs, max_tables, max_slots)
    tables_off = _align(refs_off + chunks * CHUNK_DTYPE.itemsize)
    tindex_off = _align(tables_off + max_tables * TABLE_DTYPE.itemsize)
    arena_off = _align(tindex_off + table_capacity * 4, 4096)
    arena_size = max_blocks * kv_block_bytes(num_layers, num_kv_heads, head_dim, block_size,
                                             dtype)
    total = _align(arena_off + arena_size, 4096)
    return Layout(block_size, max_blocks, bool(enable_caching), num_layers,
                  num_kv_heads, head_dim, dtype, max_slots, max_tables,
                  max_refs, chunks, hash_capacity, table_capacity, counters_off,
                  slots_off, blocks_off, hash_off, refs_off, tables_off,
                  tindex_off, arena_off, arena_size, total)


# The ranges a pool's parameters must lie in: Pool.create refuses values
# outside them, and layout_from_header refuses a header that has any.
PARAM_RANGES = {
    "block_size": (1, 65535),             # token_count is uint16
    "max_blocks": (2, MAX_BLOCKS_LIMIT),  # block 0 is the null block
    "num_layers": (0, 1 << 16),
    "num_kv_heads": (1, 1 << 16),
    "head_dim": (1, 1 << 16),
    "max_slots": (1, MAX_SLOTS_LIMIT),
    "max_tables": (1, MAX_TABLES_LIMIT),
    "max_refs": (1, MAX_REFS_LIMIT),
}


def header_checksum(hdr) -> bytes:
    """The checksum a header record (HEADER_DTYPE) must carry."""
    rec = np.array(hdr, dtype=HEADER_DTYPE).reshape(-1)[:1].copy()
    rec["ready"] = 0
    rec["checksum"] = np.zeros(1, "V16")
    return blake2b(rec.tobytes(), digest_size=16).digest()


def layout_from_header(hdr, file_size: int | None = None, where: str = "pool") -> Layout:
    """The layout a header describes, after checking that it is one this
    version writes: every parameter in range, the derived capacities and
    sizes equal to the ones recorded, the file ``file_size`` bytes long (when
    given) and the checksum right.

    Raises:
        CorruptPoolError: naming ``where`` and the first field that is wrong.
    """
    def bad(msg: str):
        raise CorruptPoolError(f"{where} has a corrupt header: {msg}")

    code = int(hdr["dtype_code"])
    if code not in DTYPE_NAMES:
        bad(f"unknown dtype code {code}")
    v = {k: int(hdr[k]) for k in PARAM_RANGES}
    for k, (lo, hi) in PARAM_RANGES.items():
        if not lo <= v[k] <= hi:
            bad(f"{k} {v[k]} is outside [{lo}, {hi}]")
    caching = int(hdr["enable_caching"])
    if caching not in (0, 1):
        bad(f"enable_caching {caching} is not 0 or 1")
    lay = compute_layout(v["block_size"], v["max_blocks"], bool(caching), v["num_layers"],
                         v["num_kv_heads"], v["head_dim"], DTYPE_NAMES[code], v["max_slots"],
                         v["max_tables"], v["max_refs"])
    for k in ("hash_capacity", "table_capacity", "total_size"):
        if int(hdr[k]) != getattr(lay, k):
            bad(f"{k} {int(hdr[k])} does not follow from its parameters ({getattr(lay, k)})")
    if file_size is not None and file_size != lay.total_size:
        bad(f"the file is {file_size} bytes, its header says {lay.total_size}")
    if bytes(hdr["checksum"]) != header_checksum(hdr):
        bad("checksum mismatch (a header byte changed after creation)")
    return lay


# The pool as the C core sees it (shmcache._hot, shmcache/_native/): the
# parameters ``Hot(buffer, params)`` takes, one row each, in the order it
# takes them: (name, value, what it is); the value is a constant of this
# byte map, or a function of the pool's Layout. This table is the one list:
# ``hot_params`` builds the tuple from it, and the C side's indices (the
# ``P_<NAME>`` enum, P_COUNT, hot_param_names) are generated from it into
# shmcache/_native/hot_params_gen.h by
#     python -m shmcache.shm.hot_params_gen > shmcache/_native/hot_params_gen.h
# (tests/test_hot_params_gen.py fails while the committed file differs). To
# add a parameter: add its row here, run that command, rebuild. Every row is
# one the C core reads (the test checks that too).
def _field(dt: np.dtype, field: str) -> int:
    assert dt.fields is not None        # (a structured dtype)
    return dt.fields[field][1]


_lay = attrgetter       # a row whose value is this Layout attribute
_B, _S, _T = BLOCK_DTYPE, SLOT_DTYPE, TABLE_DTYPE
HOT_PARAMS = (
    ("mutex_off", MUTEX_OFF, "byte offset of the pool mutex (in the header)"),
    ("counters_off", _lay("counters_off"), "byte offset of the counters (int64[NUM_COUNTERS])"),
    # block records (max_blocks, then the free list's head and tail sentinels)
    ("blocks_off", _lay("blocks_off"), "byte offset of the block records"),
    ("block_record_bytes", _B.itemsize, "bytes of a block record (BLOCK_DTYPE)"),
    ("max_blocks", _lay("max_blocks"), "block records, not counting the two sentinels"),
    ("b_ref", _field(_B, "ref_count"), "byte offset of a block record's ref_count (int32)"),
    ("b_prev", _field(_B, "prev"), "byte offset of a block record's prev (int32)"),
    ("b_next", _field(_B, "next"), "byte offset of a block record's next (int32)"),
    ("b_flags", _field(_B, "flags"), "byte offset of a block record's flags (uint16)"),
    ("b_tok", _field(_B, "token_count"), "byte offset of a block record's token_count (uint16)"),
    ("b_last", _field(_B, "last_access"), "byte offset of a block record's last_access (float32)"),
    ("b_hash", BLOCK_HASH_OFF, "byte offset of a block record's hash (HASH_BYTES)"),
    ("b_gen", _field(_B, "gen"), "byte offset of a block record's gen (uint32)"),
    ("flag_cached", FLAG_CACHED, "the flags bit of a block in the prefix index"),
    # slot records
    ("slots_off", _lay("slots_off"), "byte offset of the slot records"),
    ("slot_record_bytes", _S.itemsize, "bytes of a slot record (SLOT_DTYPE)"),
    ("max_slots", _lay("max_slots"), "slot records (0: the fused ops refuse every call)"),
    ("s_head", _field(_S, "loose_head"), "byte offset of a slot record's loose_head (int32)"),
    ("s_count", _field(_S, "loose_count"), "byte offset of a slot record's loose_count (int32)"),
    ("s_reserved", _field(_S, "reserved"), "byte offset of a slot record's reserved (int32)"),
    # reference chunks
    ("refs_off", _lay("refs_off"), "byte offset of the reference chunks"),
    ("chunk_record_bytes", CHUNK_DTYPE.itemsize, "bytes of a chunk (CHUNK_DTYPE)"),
    # table records
    ("tables_off", _lay("tables_off"), "byte offset of the table records"),
    ("table_record_bytes", _T.itemsize, "bytes of a table record (TABLE_DTYPE)"),
    ("max_tables", _lay("max_tables"), "table records"),
    ("t_state", _field(_T, "state"), "byte offset of a table record's state (int32)"),
    ("t_owner", _field(_T, "owner"), "byte offset of a table record's owner (int32)"),
    ("t_head", _field(_T, "head"), "byte offset of a table record's head (int32)"),
    ("t_tail", _field(_T, "tail"), "byte offset of a table record's tail (int32)"),
    ("t_len", _field(_T, "length"), "byte offset of a table record's length (int32)"),
    ("t_tok", _field(_T, "num_tokens"), "byte offset of a table record's num_tokens (int32)"),
    ("t_claim", _field(_T, "claim"), "byte offset of a table record's claim (int32)"),
    ("t_rid", _field(_T, "request_id"), "byte offset of a table record's request_id"),
    ("rid_bytes", RID_BYTES, "bytes of a request id"),
    ("t_rhash", _field(_T, "rid_hash"), "byte offset of a table record's rid_hash (uint64)"),
    # the two hash indexes (int32 entries, a power of two of them)
    ("hash_off", _lay("hash_off"), "byte offset of the prefix index"),
    ("hash_cap", _lay("hash_capacity"), "entries of the prefix index"),
    ("tindex_off", _lay("tindex_off"), "byte offset of the request-id index"),
    ("tindex_cap", _lay("table_capacity"), "entries of the request-id index"),
    # counter indexes
    ("c_dirty", C_DIRTY, "counter C_DIRTY"),
    ("c_num_free", C_NUM_FREE, "counter C_NUM_FREE"),
    ("c_free_ref", C_FREE_REF, "counter C_FREE_REF"),
    ("c_free_refs", C_FREE_REFS, "counter C_FREE_REFS"),
    ("c_ops", C_OPS, "counter C_OPS"),
    ("c_epoch", C_EPOCH, "counter C_EPOCH"),
    ("c_holder", C_HOLDER, "counter C_HOLDER"),
    ("c_num_tables", C_NUM_TABLES, "counter C_NUM_TABLES"),
    ("c_hits", C_HITS, "counter C_HITS"),
    ("c_misses", C_MISSES, "counter C_MISSES"),
    ("c_evictions", C_EVICTIONS, "counter C_EVICTIONS"),
    ("c_lock_wait_ns", C_LOCK_WAIT_NS, "counter C_LOCK_WAIT_NS"),
    ("c_turn_next", C_TURN_NEXT, "counter C_TURN_NEXT"),
    ("c_turn_now", C_TURN_NOW, "counter C_TURN_NOW"),
    ("c_pure", C_PURE, "counter C_PURE"),
    ("c_tokens", C_TOKENS, "counter C_TOKENS"),
)
HOT_PARAM_NAMES = tuple(name for name, _, _ in HOT_PARAMS)


def hot_params(lay: Layout) -> tuple:
    """The tuple ``_hot.Hot`` takes for a pool of layout ``lay``: every
    HOT_PARAMS row's value, in its order."""
    return tuple(v(lay) if callable(v) else v for _, v, _ in HOT_PARAMS)


def hot_params_only(**values: int) -> tuple:
    """The tuple ``_hot.Hot`` takes with only the rows named given (the
    others 0: with max_slots 0, the fused ops refuse every call)."""
    unknown = sorted(set(values) - set(HOT_PARAM_NAMES))
    if unknown:
        raise ValueError(f"not rows of layout.HOT_PARAMS: {unknown}")
    return tuple(values.get(name, 0) for name in HOT_PARAM_NAMES)
