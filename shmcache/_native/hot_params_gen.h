/* shmcache/_native/hot_params_gen.h: GENERATED from shmcache/shm/layout.py's
 * HOT_PARAMS by
 *     python -m shmcache.shm.hot_params_gen > shmcache/_native/hot_params_gen.h
 * Do not edit: change HOT_PARAMS and run that command (then rebuild).
 *
 * The index of each parameter in the tuple Hot() takes (hot_params.h's
 * HotCore.p), and their names, in HOT_PARAMS' order. */
#ifndef SHMCACHE_HOT_PARAMS_GEN_H
#define SHMCACHE_HOT_PARAMS_GEN_H

enum {
    P_MUTEX_OFF,           /* 0: byte offset of the pool mutex (in the header) */
    P_COUNTERS_OFF,        /* 1: byte offset of the counters (int64[NUM_COUNTERS]) */
    P_BLOCKS_OFF,          /* 2: byte offset of the block records */
    P_BLOCK_RECORD_BYTES,  /* 3: bytes of a block record (BLOCK_DTYPE) */
    P_MAX_BLOCKS,          /* 4: block records, not counting the two sentinels */
    P_B_REF,               /* 5: byte offset of a block record's ref_count (int32) */
    P_B_PREV,              /* 6: byte offset of a block record's prev (int32) */
    P_B_NEXT,              /* 7: byte offset of a block record's next (int32) */
    P_B_FLAGS,             /* 8: byte offset of a block record's flags (uint16) */
    P_B_TOK,               /* 9: byte offset of a block record's token_count (uint16) */
    P_B_LAST,              /* 10: byte offset of a block record's last_access (float32) */
    P_B_HASH,              /* 11: byte offset of a block record's hash (HASH_BYTES) */
    P_B_GEN,               /* 12: byte offset of a block record's gen (uint32) */
    P_FLAG_CACHED,         /* 13: the flags bit of a block in the prefix index */
    P_SLOTS_OFF,           /* 14: byte offset of the slot records */
    P_SLOT_RECORD_BYTES,   /* 15: bytes of a slot record (SLOT_DTYPE) */
    P_MAX_SLOTS,           /* 16: slot records (0: the fused ops refuse every call) */
    P_S_HEAD,              /* 17: byte offset of a slot record's loose_head (int32) */
    P_S_COUNT,             /* 18: byte offset of a slot record's loose_count (int32) */
    P_S_RESERVED,          /* 19: byte offset of a slot record's reserved (int32) */
    P_REFS_OFF,            /* 20: byte offset of the reference chunks */
    P_CHUNK_RECORD_BYTES,  /* 21: bytes of a chunk (CHUNK_DTYPE) */
    P_TABLES_OFF,          /* 22: byte offset of the table records */
    P_TABLE_RECORD_BYTES,  /* 23: bytes of a table record (TABLE_DTYPE) */
    P_MAX_TABLES,          /* 24: table records */
    P_T_STATE,             /* 25: byte offset of a table record's state (int32) */
    P_T_OWNER,             /* 26: byte offset of a table record's owner (int32) */
    P_T_HEAD,              /* 27: byte offset of a table record's head (int32) */
    P_T_TAIL,              /* 28: byte offset of a table record's tail (int32) */
    P_T_LEN,               /* 29: byte offset of a table record's length (int32) */
    P_T_TOK,               /* 30: byte offset of a table record's num_tokens (int32) */
    P_T_CLAIM,             /* 31: byte offset of a table record's claim (int32) */
    P_T_RID,               /* 32: byte offset of a table record's request_id */
    P_RID_BYTES,           /* 33: bytes of a request id */
    P_T_RHASH,             /* 34: byte offset of a table record's rid_hash (uint64) */
    P_HASH_OFF,            /* 35: byte offset of the prefix index */
    P_HASH_CAP,            /* 36: entries of the prefix index */
    P_TINDEX_OFF,          /* 37: byte offset of the request-id index */
    P_TINDEX_CAP,          /* 38: entries of the request-id index */
    P_C_DIRTY,             /* 39: counter C_DIRTY */
    P_C_NUM_FREE,          /* 40: counter C_NUM_FREE */
    P_C_FREE_REF,          /* 41: counter C_FREE_REF */
    P_C_FREE_REFS,         /* 42: counter C_FREE_REFS */
    P_C_OPS,               /* 43: counter C_OPS */
    P_C_EPOCH,             /* 44: counter C_EPOCH */
    P_C_HOLDER,            /* 45: counter C_HOLDER */
    P_C_NUM_TABLES,        /* 46: counter C_NUM_TABLES */
    P_C_HITS,              /* 47: counter C_HITS */
    P_C_MISSES,            /* 48: counter C_MISSES */
    P_C_EVICTIONS,         /* 49: counter C_EVICTIONS */
    P_C_LOCK_WAIT_NS,      /* 50: counter C_LOCK_WAIT_NS */
    P_C_TURN_NEXT,         /* 51: counter C_TURN_NEXT */
    P_C_TURN_NOW,          /* 52: counter C_TURN_NOW */
    P_C_PURE,              /* 53: counter C_PURE */
    P_C_TOKENS,            /* 54: counter C_TOKENS */
    P_COUNT
};

static const char *const hot_param_names[P_COUNT] = {
    "mutex_off",
    "counters_off",
    "blocks_off",
    "block_record_bytes",
    "max_blocks",
    "b_ref",
    "b_prev",
    "b_next",
    "b_flags",
    "b_tok",
    "b_last",
    "b_hash",
    "b_gen",
    "flag_cached",
    "slots_off",
    "slot_record_bytes",
    "max_slots",
    "s_head",
    "s_count",
    "s_reserved",
    "refs_off",
    "chunk_record_bytes",
    "tables_off",
    "table_record_bytes",
    "max_tables",
    "t_state",
    "t_owner",
    "t_head",
    "t_tail",
    "t_len",
    "t_tok",
    "t_claim",
    "t_rid",
    "rid_bytes",
    "t_rhash",
    "hash_off",
    "hash_cap",
    "tindex_off",
    "tindex_cap",
    "c_dirty",
    "c_num_free",
    "c_free_ref",
    "c_free_refs",
    "c_ops",
    "c_epoch",
    "c_holder",
    "c_num_tables",
    "c_hits",
    "c_misses",
    "c_evictions",
    "c_lock_wait_ns",
    "c_turn_next",
    "c_turn_now",
    "c_pure",
    "c_tokens",
};

#endif
