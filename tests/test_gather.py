"""shmcache._gather.gather: the C gather copy behind kv.read.

The extension is optional; where it is not built kv.read uses numpy's take,
which tests/test_kv.py covers when run with SHMCACHE_PURE=1.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gather = pytest.importorskip("shmcache._gather").gather


def I64(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def reference(dst, src, ids, src_offs, dst_offs, chunk, stride=None) -> None:
    """The contract, as a plain loop over numpy byte views."""
    d, s = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    stride = chunk if stride is None else stride
    for so, do in zip(src_offs, dst_offs):
        for i, b in enumerate(ids):
            d[do + i * chunk:do + (i + 1) * chunk] = s[so + b * stride:so + b * stride + chunk]


def make_case(rng, chunk, n_ids, m, nsrc=6, stride=None):
    """Random src, ids (with repeats) and m source/destination regions.

    Destination regions get random gaps (so offsets are unaligned and bytes
    between them must stay as they were) and a random order; they never
    overlap, since overlapping writes from several threads have no defined
    result.
    """
    src_offs = rng.integers(0, 300, m)
    span = (nsrc - 1) * (chunk if stride is None else stride) + chunk
    src = rng.integers(0, 256, int(src_offs.max(initial=0)) + span + rng.integers(0, 9),
                       dtype=np.uint8).tobytes()
    ids = rng.integers(0, nsrc, n_ids).astype(np.int64)
    size, starts = n_ids * chunk, []
    pos = int(rng.integers(0, 9))
    for _ in range(m):
        starts.append(pos)
        pos += size + int(rng.integers(0, 9))
    dst_offs = np.array(rng.permutation(starts), dtype=np.int64).reshape(m)
    dst = rng.integers(0, 256, pos + int(rng.integers(0, 9)), dtype=np.uint8)
    return dst, src, ids, src_offs.astype(np.int64), dst_offs


def check_against_reference(seed, chunk, n_ids, m, threads, stride=None):
    dst, src, ids, so, do = make_case(np.random.default_rng(seed), chunk, n_ids, m, stride=stride)
    want = dst.copy()
    reference(want, src, ids, so, do, chunk, stride)
    gather(dst, src, ids, so, do, chunk, threads, *([] if stride is None else [stride]))
    # Whole-buffer equality: also checks every byte outside the chunks.
    assert dst.tobytes() == want.tobytes()


# Multiples of 128 take the AVX2 path where the CPU has it, the rest memcpy.
CHUNKS = [1, 3, 64, 100, 127, 128, 256, 384, 1000, 4096]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), chunk=st.sampled_from(CHUNKS),
       n_ids=st.integers(0, 12), m=st.integers(0, 5),
       threads=st.sampled_from([-3, 0, 1, 2, 3, 8, 9, 1000]))
def test_matches_reference(seed, chunk, n_ids, m, threads):
    check_against_reference(seed, chunk, n_ids, m, threads)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), chunk=st.sampled_from(CHUNKS),
       n_ids=st.integers(0, 12), m=st.integers(0, 9), threads=st.sampled_from([1, 2, 3]),
       stride_in_chunks=st.sampled_from([0, 1, 2, 8]), extra=st.integers(0, 70))
def test_matches_reference_with_a_block_stride(seed, chunk, n_ids, m, threads,
                                               stride_in_chunks, extra):
    # The arena's way: ids step a whole block (2*H chunks), regions are (K|V, head).
    check_against_reference(seed, chunk, n_ids, m, threads, stride_in_chunks * chunk + extra)


def test_stride_picks_runs_of_chunks():
    # 3 blocks of 2 chunks of 4 bytes: block b's chunk j is at b*8 + j*4.
    src = bytes(range(24))
    dst = bytearray(16)
    gather(dst, src, I64(2, 0), I64(0, 4), I64(0, 8), 4, 1, 8)
    assert bytes(dst) == bytes([16, 17, 18, 19, 0, 1, 2, 3, 20, 21, 22, 23, 4, 5, 6, 7])


@pytest.mark.parametrize("threads", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("chunk", [128, 4096, 100, 4097])
def test_threads_and_chunks(threads, chunk):
    # 40 ids over 4 regions = 160 tasks, split unevenly over 3 threads.
    check_against_reference(threads * 7919 + chunk, chunk, 40, 4, threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("skew", [0, 8, 32])
@pytest.mark.parametrize("above", [(), (0, 0), (0, 1 << 62), (1 << 62, 0)])
def test_large_copies_stream_exactly(threads, skew, above):
    # Over 4 MiB in 128-byte multiples: the non-temporal store path, which
    # takes only 32-byte aligned destination chunks (skew 8: none are);
    # `above`: the default thresholds, or streaming alone and/or shared
    # forced on or off, so that one copy mixes both kinds of store.
    rng = np.random.default_rng(skew + threads)
    chunk, nblk, m = 2048, 300, 8
    src = rng.integers(0, 256, nblk * m * chunk, dtype=np.uint8)
    ids = rng.permutation(nblk)[:280].astype(np.int64)
    so = np.arange(m, dtype=np.int64) * chunk
    do = skew + np.arange(m, dtype=np.int64) * len(ids) * chunk
    dst = np.full(skew + m * len(ids) * chunk + 64, 0x5A, np.uint8)
    assert m * len(ids) * chunk > 4 << 20
    want = dst.copy()
    reference(want, src, ids, so, do, chunk, m * chunk)
    gather(dst, src, ids, so, do, chunk, threads, m * chunk, *above)
    assert dst.tobytes() == want.tobytes()


def test_more_threads_than_tasks():
    check_against_reference(1, 128, 1, 1, 8)
    check_against_reference(2, 100, 3, 1, 8)


@pytest.mark.parametrize("chunk", [32, 64, 96, 128, 160, 256, 4160])
def test_duplicate_ids_and_untouched_bytes(chunk):
    # Sentinels of 512 bytes on both sides: a copy that rounds the chunk up
    # (e.g. 128-byte vector steps on a 64-byte chunk) would hit them.
    src = np.random.default_rng(chunk).integers(0, 256, 4 * chunk, dtype=np.uint8)
    dst = np.full(5 + 3 * chunk + 512, 0xAB, np.uint8)
    gather(dst, src, I64(2, 2, 0), I64(0), I64(5), chunk, 1)
    c = [src[k * chunk:(k + 1) * chunk].tobytes() for k in (2, 2, 0)]
    assert dst[5:5 + 3 * chunk].tobytes() == b"".join(c)
    assert (dst[:5] == 0xAB).all() and (dst[5 + 3 * chunk:] == 0xAB).all()


def test_empty_ids_and_no_offsets_write_nothing():
    dst = np.full(64, 7, np.uint8)
    gather(dst, bytes(64), I64(), I64(0, 3), I64(0, 64), 16, 4)   # dst offset at the very end is fine
    gather(dst, bytes(64), I64(1), I64(), I64(), 16, 4)
    assert (dst == 7).all()


def test_accepts_other_buffer_types():
    dst, src = bytearray(8), bytes(range(16))
    gather(memoryview(dst), memoryview(src), I64(1, 0), I64(0), I64(0), 4, 1)
    assert bytes(dst) == bytes([4, 5, 6, 7, 0, 1, 2, 3])


def _readonly():
    a = np.zeros(64, np.uint8)
    a.flags.writeable = False
    return a


def _args(**kw):
    # A valid call (src 4 chunks of 8, dst 2 regions of 2 chunks), then one thing broken.
    a = dict(dst=np.full(40, 0xEE, np.uint8), src=bytes(range(32)), ids=I64(3, 0),
             src_offsets=I64(0, 0), dst_offsets=I64(0, 16), chunk=8, threads=2)
    a.update(kw)
    return a


BAD = {
    "negative id": (_args(ids=I64(0, -1)), ValueError, "negative id -1"),
    "id past src": (_args(ids=I64(0, 4)), ValueError, r"src_offsets\[0\].*id 4 reads past"),
    "src offset negative": (_args(src_offsets=I64(0, -1)), ValueError, r"src_offsets\[1\]=-1"),
    "src offset reads past": (_args(src_offsets=I64(1, 0)), ValueError, r"src_offsets\[0\]=1 .*reads past"),
    "dst offset negative": (_args(dst_offsets=I64(-1, 16)), ValueError, r"dst_offsets\[0\]=-1"),
    "dst offset writes past": (_args(dst_offsets=I64(0, 25)), ValueError, r"dst_offsets\[1\]=25 .*writes past"),
    "huge src offset": (_args(src_offsets=I64(2**63 - 8, 0)), ValueError, "src_offsets"),
    "huge dst offset": (_args(dst_offsets=I64(0, 2**63 - 8)), ValueError, "dst_offsets"),
    "huge id": (_args(ids=I64(0, 2**62)), ValueError, "reads past"),
    "length mismatch": (_args(dst_offsets=I64(0)), ValueError, "2 src_offsets but 1 dst_offsets"),
    "length mismatch (more dst)": (_args(src_offsets=I64(0)), ValueError, "1 src_offsets but 2 dst_offsets"),
    "chunk zero": (_args(chunk=0), ValueError, "chunk must be positive, got 0"),
    "chunk negative": (_args(chunk=-8), ValueError, "chunk must be positive"),
    "stride negative": (_args(stride=-8), ValueError, "stride must not be negative, got -8"),
    "stride reads past": (_args(stride=9), ValueError, r"src_offsets\[0\]=0 with id 3 reads past"),
    "int32 ids": (_args(ids=np.array([3, 0], np.int32)), TypeError, "ids must be a buffer of int64"),
    "float ids": (_args(ids=np.array([3.0, 0.0])), TypeError, "ids must be"),
    "int32 src_offsets": (_args(src_offsets=np.zeros(2, np.int32)), TypeError, "src_offsets must be"),
    "int32 dst_offsets": (_args(dst_offsets=np.zeros(2, np.int32)), TypeError, "dst_offsets must be"),
    "non-contiguous ids": (_args(ids=np.arange(4, dtype=np.int64)[::2]), ValueError, "contiguous"),
    "non-contiguous src": (_args(src=np.zeros(64, np.uint8)[::2]), ValueError, "contiguous"),
    # numpy's and CPython's own buffer errors: they do not say which argument.
    "bytes dst": (_args(dst=bytes(40)), BufferError, "not writable"),
    "read-only dst": (_args(dst=_readonly()), ValueError, "read-only"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises_before_writing(name):
    args, exc, match = BAD[name]
    before = bytes(args["dst"])
    with pytest.raises(exc, match=match):
        gather(*args.values())   # _args keeps the positional order
    assert bytes(args["dst"]) == before


def test_bad_input_base_call_is_valid():
    # The calls BAD breaks differ from this one only in what they break.
    a = _args()
    gather(*a.values())
    assert bytes(a["dst"][:16]) == bytes(range(24, 32)) + bytes(range(8))
    assert bytes(a["dst"][16:32]) == bytes(range(24, 32)) + bytes(range(8))
    assert (a["dst"][32:] == 0xEE).all()


@pytest.mark.timeout(60)
def test_gil_released_during_copy():
    # 128 MiB in 32 KiB chunks, one thread: long enough for the other thread
    # to wake from its sleep while the copy runs. The switch interval is made
    # huge so the main thread never hands over the GIL by itself between
    # setting and clearing `busy`: the helper can only see busy=True if the
    # copy itself released the GIL.
    chunk, n = 32 << 10, 4096
    src = np.ones(n * chunk, np.uint8)
    dst = np.empty_like(src)
    ids, busy, seen, stop = np.arange(n, dtype=np.int64), [False], [0], [False]

    def helper():
        while not stop[0]:
            if busy[0]:
                seen[0] += 1
            time.sleep(0.0002)        # releases the GIL every turn

    old = sys.getswitchinterval()
    t = threading.Thread(target=helper)
    t.start()
    try:
        sys.setswitchinterval(30.0)
        for _ in range(3):            # a few tries, in case the helper was not scheduled
            busy[0] = True
            gather(dst, src, ids, I64(0), I64(0), chunk, 1)
            busy[0] = False
            if seen[0]:
                break
            time.sleep(0.01)
    finally:
        sys.setswitchinterval(old)
        stop[0] = True
        t.join()
    assert seen[0] > 0
    assert dst[::4096].all()
