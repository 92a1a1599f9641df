"""engine/worker_ext.py: the NIXL connector's constructor leaves the calling thread on its cores."""

from __future__ import annotations

import os

import pytest

from engine.worker_ext import keep_affinity


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move a thread between")
def test_a_constructor_that_moves_the_thread_leaves_it_where_it_was() -> None:
    before = os.sched_getaffinity(0)

    def init() -> None:  # as vLLM's NIXL worker does on CPU: the last core of each NUMA node
        os.sched_setaffinity(0, {max(before)})

    try:
        keep_affinity(init)()
        assert os.sched_getaffinity(0) == before
        with pytest.raises(RuntimeError):  # and when it fails
            keep_affinity(lambda: (init(), (_ for _ in ()).throw(RuntimeError("boom"))))()
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
