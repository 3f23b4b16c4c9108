"""``dtensor_patches.testing.RankPool``: a rank that dies inside a collective (as a gloo
collective mismatch aborts it) fails the call within seconds, naming the rank, instead of
waiting out the pool's timeout while the other ranks wait for it in the collective."""

from __future__ import annotations

import time

import pytest

from dtensor_patches.testing import RankError, RankPool


def _one_rank_dies_while_the_other_is_stuck() -> None:
    import os

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    # Rank 0 never returns by itself: as a rank waiting in a collective whose peer aborted
    # (gloo's "collective mismatch"), which no timeout of gloo's ends soon.
    time.sleep(600)


def test_a_rank_that_exits_fails_the_call_without_the_timeout() -> None:
    with RankPool(2, timeout=300) as pool:
        pool.wait_ready()
        start = time.monotonic()
        with pytest.raises(RankError) as raised:
            pool.run(_one_rank_dies_while_the_other_is_stuck)
        elapsed = time.monotonic() - start
        assert pool.closed  # its ranks may be stuck: never reused
    assert "exited (exit code" in raised.value.failures[1]
    assert "did not answer after a rank exited" in raised.value.failures[0]
    assert elapsed < 120, f"waited {elapsed:.0f} s (the pool's timeout is 300 s)"


def _answer(value: int) -> int:
    return value * 2


def test_replies_come_back_in_rank_order(pool2: RankPool) -> None:
    assert pool2.run(_answer, 21) == [42, 42]


def _slow_answer(seconds: float) -> int:
    time.sleep(seconds)
    return 1


def test_startup_has_its_own_timeout_and_calls_keep_theirs() -> None:
    # Two ranks importing torch on a busy machine can take longer than a short call timeout:
    # ``startup_timeout`` bounds the start, and the short ``timeout`` still ends a call.
    with RankPool(2, timeout=3, startup_timeout=300) as pool:
        pool.wait_ready()
        assert pool.timeout == 3
        assert pool.run(_slow_answer, 0.0) == [1, 1]
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="within 3 s"):
            pool.run(_slow_answer, 60.0)
        assert time.monotonic() - start < 30
