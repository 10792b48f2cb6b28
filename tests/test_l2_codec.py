"""L2 keys and values (``shmcache.l2.codec``): a value's round trip and
header, every corruption rejected, chain keys and what separates them, large
blocks cut into layer chunks. Nothing here needs Redis.
"""

from __future__ import annotations

import numpy as np
import pytest

from shmcache import l2 as L2
from shmcache.l2 import Codec, KVLayout, Rejected

from _l2 import LAY, SECRET

pytestmark = pytest.mark.timeout(120)


def payload(codec: Codec, seed: int, chunk: int = 0) -> bytes:
    lo, hi = codec.chunks[chunk]
    n = (hi - lo) * codec.layout.layer_bytes // codec.layout.np_dtype.itemsize
    return np.random.default_rng(seed).integers(0, 60000, n).astype(codec.layout.np_dtype).tobytes()


# ------------------------------------------------------------------ codec
def test_value_round_trip_and_header():
    c = Codec(LAY, SECRET)
    h = c.chain(list(range(8)), 2)[1]
    data = payload(c, 1)
    v = c.encode(h, 0, data)
    assert len(v) == L2.HEADER_BYTES + LAY.block_bytes
    assert v[:6] == b"SHMCKV" and v[6] == L2.FORMAT_VERSION
    assert bytes(c.decode(v, h, 0)) == data
    a = c.chunk_array(c.decode(v, h, 0), 0)
    assert a.shape == (2, 2, 2, 4, 8) and a.dtype == np.float32


def _corruptions(c: Codec, h: bytes, v: bytes):
    other = Codec(KVLayout("tiny@abc", "float32", 4, 2, 2, 16), SECRET)     # head_dim 16
    hdr = L2._HDR
    fields = list(hdr.unpack_from(v))
    yield "truncated header", v[:20]
    yield "truncated payload", v[:-1]
    yield "extra bytes", v + b"\0"
    yield "a payload byte flipped", v[:-5] + bytes([v[-5] ^ 1]) + v[-4:]
    yield "a header byte flipped", v[:30] + bytes([v[30] ^ 0x40]) + v[31:]
    yield "the MAC flipped", v[:L2._MAC_OFF] + bytes([v[L2._MAC_OFF] ^ 1]) + v[L2._MAC_OFF + 1:]
    yield "bad magic", b"XXXXXX" + v[6:]
    bad = list(fields); bad[1] = 2
    yield "version 2", hdr.pack(*bad) + v[hdr.size:]
    yield "another block's value", c.encode(c.chain([9] * 8, 2)[1], 0, v[hdr.size:])
    yield "another layout's value", other.encode(h, 0, bytes(other.layout.block_bytes))
    yield "another secret's value", Codec(LAY, b"other").encode(h, 0, v[hdr.size:])
    bad = list(fields); bad[9] = fields[9] - 4               # payload length lies
    yield "a lying length", hdr.pack(*bad) + v[hdr.size:-4]
    yield "empty", b""


def test_every_corruption_is_rejected():
    c = Codec(LAY, SECRET)
    h = c.chain(list(range(8)), 2)[1]
    v = c.encode(h, 0, payload(c, 2))
    seen = 0
    for what, bad in _corruptions(c, h, v):
        with pytest.raises(Rejected):
            c.decode(bad, h, 0)
            pytest.fail(f"{what}: accepted")
        seen += 1
    assert seen == 13


def test_keys_are_deterministic_and_separated_by_secret_salt_tokens_and_layout():
    toks = list(range(100, 120))                              # 5 blocks of 4
    a = Codec(LAY, SECRET)
    assert a.chain(toks, 5) == Codec(LAY, SECRET).chain(toks, 5)      # another process, same keys
    assert a.chain(toks, 5, prev=a.chain(toks, 2)) == a.chain(toks, 5)
    assert a.chain(toks, 3) == a.chain(toks, 5)[:3]
    assert all(len(h) == 16 for h in a.chain(toks, 5))
    sets = {
        "base": a.chain(toks, 5),
        "salt t1": a.chain(toks, 5, ("t1",)),
        "salt t2": a.chain(toks, 5, ("t2",)),
        "secret": Codec(LAY, b"another").chain(toks, 5),
        "model": Codec(KVLayout("other@abc", "float32", 4, 2, 2, 8), SECRET).chain(toks, 5),
        "dtype": Codec(KVLayout("tiny@abc", "float16", 4, 2, 2, 8), SECRET).chain(toks, 5),
        "layers": Codec(KVLayout("tiny@abc", "float32", 4, 3, 2, 8), SECRET).chain(toks, 5),
        "heads": Codec(KVLayout("tiny@abc", "float32", 4, 2, 1, 8), SECRET).chain(toks, 5),
        "chunking": Codec(LAY, SECRET, max_value_bytes=LAY.layer_bytes).chain(toks, 5),
    }
    flat = [h for hs in sets.values() for h in hs]
    assert len(set(flat)) == len(flat), "two chains share a hash"
    # a changed token changes its block's key and every later one, not earlier ones
    t2 = list(toks)
    t2[9] += 1
    b = a.chain(t2, 5)
    assert b[:2] == sets["base"][:2] and all(x != y for x, y in zip(b[2:], sets["base"][2:]))
    # the layout is in the Redis key's prefix (an operator can tell layouts apart)
    k1 = a.keys(sets["base"][0])[0]
    k2 = Codec(KVLayout("tiny@abc", "float16", 4, 2, 2, 8), SECRET).keys(sets["base"][0])[0]
    assert k1.startswith(b"shmcache:kv1:") and k1.split(b":")[2] != k2.split(b":")[2]
    # a block size 8 chain is not a block size 4 chain
    c8 = Codec(KVLayout("tiny@abc", "float32", 8, 2, 2, 8), SECRET)
    assert not set(c8.chain(toks[:16], 2)) & set(a.chain(toks[:16], 4))


def test_large_blocks_are_cut_into_layer_chunks():
    lay = KVLayout("big@x", "bfloat16", 4, 5, 2, 8)
    c = Codec(lay, SECRET, max_value_bytes=2 * lay.layer_bytes)
    assert c.chunks == [(0, 2), (2, 4), (4, 5)]
    h = c.chain([1] * 4, 1)[0]
    keys = c.keys(h)
    assert len(keys) == 3 and keys[1].endswith(b":c1")
    for j in range(3):
        v = c.encode(h, j, payload(c, j, j))
        assert bytes(c.decode(v, h, j)) == payload(c, j, j)
        with pytest.raises(Rejected):
            c.decode(v, h, (j + 1) % 3)                  # a chunk under another chunk's key
