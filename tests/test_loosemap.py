"""loosemap.LooseMap against a plain dict of lists (the model), and its
invariant after every step; the C path's use of the same array is compared
byte for byte with this one in test_hot.py."""

import random

import numpy as np
import pytest

from shmcache.shm.loosemap import LooseMap


def _check(m: LooseMap, model: dict) -> None:
    assert m.as_dict() == {b: ws for b, ws in model.items() if ws}
    assert len(m) == sum(1 for ws in model.values() if ws)
    for b in range(m.max_blocks):
        ws = model.get(b, [])
        assert m.count(b) == len(ws)
        assert m.top(b) == (ws[-1] if ws else -1)
        for w in ws:
            assert m.has_word(b, w)
    used = {w for ws in model.values() for w in ws}
    for w in range(m.words):
        if w not in used:     # a word in no stack has both links 0
            assert m._older[w] == 0 and m._newer[w] == 0
            assert not any(m.has_word(b, w) for b in range(m.max_blocks))


def test_against_a_dict_of_lists():
    rng = random.Random(7)
    m, model = LooseMap(9, 64), {}
    free_words = list(range(64))
    for _ in range(3000):
        op = rng.random()
        held = [b for b, ws in model.items() if ws]
        if op < 0.45 and free_words:
            b, w = rng.randrange(9), free_words.pop(rng.randrange(len(free_words)))
            m.push(b, w)
            model.setdefault(b, []).append(w)
        elif op < 0.8 and held:
            b = rng.choice(held)
            w = model[b].pop()
            assert m.pop(b) == w
            free_words.append(w)
        elif held and free_words:
            # move: a held word's place taken by a free word, same position
            b = rng.choice(held)
            i = rng.randrange(len(model[b]))
            old, new = model[b][i], free_words.pop(rng.randrange(len(free_words)))
            m.move(b, old, new)
            model[b][i] = new
            free_words.append(old)
        _check(m, model)
    m.clear()
    assert len(m) == 0 and not m.buf.any()


def test_pop_is_newest_first_and_move_keeps_position():
    m = LooseMap(4, 16)
    for w in (3, 5, 7):
        m.push(2, w)
    m.move(2, 5, 11)
    assert m.as_dict() == {2: [3, 11, 7]}
    assert m.pop(2) == 7 and m.pop(2) == 11 and m.pop(2) == 3
    assert len(m) == 0 and not m.buf.any()


def test_out_of_range_reads_are_empty_not_errors():
    m = LooseMap(4, 16)
    assert m.count(-1) == 0 and m.count(4) == 0
    assert not m.has_word(9, 1) and not m.has_word(1, 99)


def test_sizes_that_do_not_fit_int32_links_are_refused():
    with pytest.raises(ValueError, match="int32"):
        LooseMap(2**30, 2**30)
    with pytest.raises(ValueError):
        LooseMap(0, 16)


def test_the_array_is_what_c_sees():
    m = LooseMap(5, 32)
    assert m.buf.dtype == np.int32 and m.buf.size == 2 * 5 + 2 * 32
    m.push(3, 17)
    assert m.buf[3] == 1 and m.buf[5 + 3] == 18    # count, top link (word + 1)
