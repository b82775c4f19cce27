"""The feature buffer manager: invariants under random and concurrent interleavings."""
import threading
import time

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lightning_ooc.store.feature_buffer import BufferClosedError, FeatureBuffer, required_slots

N, F, MAXB, EXTRACTORS, QUEUE = 40, 3, 6, 2, 1


def _row(ids: torch.Tensor) -> torch.Tensor:
    return ids.to(torch.float32)[:, None].repeat(1, F) + torch.arange(F)


class BufferMachine(RuleBasedStateMachine):
    """Batches are acquired, loaded, read and released in random order; tables must stay consistent."""

    @initialize(extra=st.integers(0, 10))
    def setup(self, extra):
        reserve = required_slots(MAXB, EXTRACTORS, QUEUE, "in_order")  # the machine keeps up to E + Q + 2 batches
        self.buf = FeatureBuffer(reserve + extra, N, F, reserve=reserve)
        self.batches = []  # (acquired, loaded)

    @precondition(lambda self: len(self.batches) < EXTRACTORS + QUEUE + 2)
    @rule(ids=st.lists(st.integers(0, N - 1), min_size=1, max_size=MAXB, unique=True))
    def acquire(self, ids):
        ids = torch.tensor(ids)
        before = self.buf.node2slot[ids].clone()
        a = self.buf.acquire(ids, timeout=5)
        assert torch.equal(self.buf.slot2node[a.slots], ids)
        assert torch.equal(a.hit | a.in_flight | a.miss, torch.ones_like(a.hit))
        assert not bool((a.hit & a.miss).any() or (a.in_flight & a.miss).any())
        assert bool((before[a.hit | a.in_flight] >= 0).all()) and bool((before[a.miss] == -1).all())
        assert bool((self.buf.refcount[a.slots] >= 1).all())
        self.batches.append([a, False])

    @precondition(lambda self: any(not loaded for _, loaded in self.batches))
    @rule(k=st.integers(0, 10))
    def load(self, k):
        todo = [b for b in self.batches if not b[1]]
        b = todo[k % len(todo)]
        a = b[0]
        self.buf.rows[a.slots[a.miss]] = _row(a.ids[a.miss])
        self.buf.mark_valid(a.slots[a.miss])
        b[1] = True

    @precondition(lambda self: any(loaded for _, loaded in self.batches))
    @rule(k=st.integers(0, 10))
    def read_and_release(self, k):
        done = [b for b in self.batches if b[1]]
        b = done[k % len(done)]
        a = b[0]
        # rows another batch was loading must be valid before they are read
        if bool(self.buf.valid[a.slots].all()):
            assert torch.equal(self.buf.rows[a.slots], _row(a.ids))  # the right row, never another node's
            self.buf.release(a.slots)
            self.batches = [x for x in self.batches if x is not b]

    @invariant()
    def tables_agree(self):
        if hasattr(self, "buf"):
            self.buf.check_invariants()
            held = sum(int(b[0].slots.numel()) for b in self.batches)
            assert int(self.buf.refcount.sum()) == held
            # a valid, unreferenced row keeps its node: it can be hit again
            standby = (self.buf.refcount == 0) & self.buf.valid
            assert bool((self.buf.slot2node[standby] >= 0).all())


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_lru_order_and_reuse():
    buf = FeatureBuffer(3, 10, 1)
    for node in (1, 2, 3):
        a = buf.acquire(torch.tensor([node]))
        buf.rows[a.slots] = float(node)
        buf.mark_valid(a.slots)
        buf.release(a.slots)
    a = buf.acquire(torch.tensor([2]))  # hit on standby: leaves the standby list
    assert a.hit.all() and buf.rows[a.slots].item() == 2.0
    b = buf.acquire(torch.tensor([7]))  # evicts the least recently released: node 1
    assert buf.node2slot[1] == -1 and buf.node2slot[3] >= 0 and buf.node2slot[2] >= 0
    buf.release(a.slots)
    c = buf.acquire(torch.tensor([8, 9]))  # evicts 3 (released before 2), then 2
    assert buf.node2slot[3] == -1 and buf.node2slot[2] == -1 and c.miss.all()
    buf.check_invariants()
    assert buf.evictions == 3
    with pytest.raises(RuntimeError, match="released slots"):
        buf.release(b.slots)
        buf.release(b.slots)


def test_too_small_buffer_is_refused():
    assert required_slots(8, 3, 1) == 24 and required_slots(8, 3, 1, "in_order") == 48
    with pytest.raises(ValueError, match="needs at least 48"):
        FeatureBuffer(10, 100, 4, reserve=required_slots(8, 3, 1, "in_order"))


def test_concurrent_extractors_share_rows_and_never_read_twice():
    """Four threads load overlapping batches over more nodes than slots; a row is loaded again only after
    it was evicted, and every read is right."""
    torch.manual_seed(0)
    maxb, ext, nodes = 16, 4, 200
    buf = FeatureBuffer(required_slots(maxb, ext, 0), nodes, F, reserve=required_slots(maxb, ext, 0))  # 4 batches
    loads = torch.zeros(nodes, dtype=torch.int64)
    lock = threading.Lock()
    errors = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(300):
                ids = torch.randperm(nodes, generator=g)[: int(torch.randint(1, maxb + 1, (1,), generator=g))]
                a = buf.acquire(ids, timeout=20)
                if a.miss.any():
                    with lock:
                        loads[a.ids[a.miss]] += 1
                    buf.rows[a.slots[a.miss]] = _row(a.ids[a.miss])
                    buf.mark_valid(a.slots[a.miss])
                buf.wait_valid(a.slots, timeout=20)
                if not torch.equal(buf.rows[a.slots], _row(ids)):
                    errors.append("wrong row")
                buf.release(a.slots)
        except Exception as e:  # surfaced below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(ext)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    buf.check_invariants()
    assert int(buf.refcount.sum()) == 0
    assert buf.in_flight_hits + buf.hits > 0 and buf.evictions > 0
    # Every load of a row ends either in its eviction or with the row still resident, so a row loaded
    # twice while it was mapped (two callers both told "miss") breaks this equality.
    resident = int((buf.node2slot >= 0).sum())
    assert int(loads.sum()) == buf.evictions + resident


def test_close_wakes_waiters():
    buf = FeatureBuffer(2, 10, 1)
    a = buf.acquire(torch.tensor([0, 1]))
    seen = []

    def wait_for_slots():
        try:
            buf.acquire(torch.tensor([5]))
        except BufferClosedError as e:
            seen.append(e)

    t = threading.Thread(target=wait_for_slots)
    t.start()
    deadline = time.monotonic() + 60
    while not buf._changed._waiters and time.monotonic() < deadline:  # until it waits for free slots
        t.join(0.01)
    assert t.is_alive() and buf._changed._waiters  # blocked: both slots are referenced
    buf.close()
    t.join(10)
    assert not t.is_alive() and len(seen) == 1
    assert buf.refcount[a.slots].tolist() == [1, 1]  # the waiter gave back nothing it did not hold
