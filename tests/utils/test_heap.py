"""freeze_heap / thaw_heap: the start-up heap out of the collector's walks, and back."""

from __future__ import annotations

import gc
import weakref

from verl.utils.heap import freeze_heap, thaw_heap


def test_freeze_moves_the_live_objects_out_of_collection_and_thaw_brings_them_back():
    kept = [[i] for i in range(1000)]  # tracked containers alive at the freeze
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= len(kept)  # every live container, ours included
        assert not any(o is kept[0] for o in gc.get_objects())  # no generation holds it now
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
    assert all(gc.is_tracked(x) for x in kept[:3])


def test_a_cycle_made_after_the_freeze_is_still_collected():
    class Node:
        pass

    try:
        freeze_heap()
        before = gc.get_freeze_count()
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle only the collector can free
        refs = weakref.ref(a), weakref.ref(b)
        del a, b
        gc.collect()
        assert refs[0]() is None and refs[1]() is None  # the cycle was found and freed
        # it never joined the frozen generation; frozen objects may die meanwhile (another
        # thread of the test process dropping its last reference), so the count can only fall
        assert gc.get_freeze_count() <= before
    finally:
        thaw_heap()
