"""Which part leaks (policy/leak_watch.py): net growth over a part's lone calls after its warm
ones, never a call beside another call or a load, and books that start afresh at each load."""

from __future__ import annotations

import pytest

from ipnext.policy.leak_watch import MIB, LeakWatch
from ipnext.policy.pool_cache import PartKey

A, B = PartKey("alpha", "embed", "s1"), PartKey("beta", "embed", "s1")


def calls(watch: LeakWatch, key: PartKey, rss: int, grow: int, n: int) -> tuple[int, list[str | None]]:
    answers = []
    for _ in range(n):
        call = watch.begin(key, rss)
        rss += grow
        answers.append(watch.end(call, rss))
    return rss, answers


def test_net_growth_past_the_limit_after_the_warm_calls_is_a_leak() -> None:
    watch = LeakWatch(leak_bytes=10 * MIB, warm_calls=2)
    _, answers = calls(watch, A, 100 * MIB, 3 * MIB, 6)
    assert answers[:5] == [None] * 5  # 2 warm, then 3, 6, 9 MiB
    assert answers[5] is not None and "12 MiB over 4 lone calls" in answers[5]


def test_memory_that_comes_and_goes_is_no_leak() -> None:
    watch = LeakWatch(leak_bytes=10 * MIB, warm_calls=0)
    rss = 100 * MIB
    for _ in range(100):
        call = watch.begin(A, rss)
        assert watch.end(call, rss + 4 * MIB) is None  # up 4 MiB
        call = watch.begin(A, rss + 4 * MIB)
        assert watch.end(call, rss) is None  # and back
    assert watch.grown()[A] == 0


def test_a_call_beside_another_call_or_a_load_is_not_charged() -> None:
    watch = LeakWatch(leak_bytes=1, warm_calls=0)
    first = watch.begin(A, 0)
    second = watch.begin(B, 0)  # began while A ran: not alone
    assert watch.end(second, 50 * MIB) is None
    assert watch.end(first, 50 * MIB) is None  # another call began before it ended
    watch.load_began()
    call = watch.begin(A, 0)
    assert watch.end(call, 50 * MIB) is None  # a load under way: its memory is nobody's call's
    watch.load_ended(B)
    call = watch.begin(A, 0)
    watch.unloaded(B)  # an unload while it ran
    assert watch.end(call, 50 * MIB) is None
    assert watch.grown() == {}


def test_a_load_starts_the_part_afresh_and_zero_turns_the_watch_off() -> None:
    watch = LeakWatch(leak_bytes=10 * MIB, warm_calls=0)
    calls(watch, A, 0, 4 * MIB, 2)
    assert watch.grown()[A] == 8 * MIB
    watch.load_began()
    watch.load_ended(A)
    assert A not in watch.grown()
    off = LeakWatch(leak_bytes=0)
    assert not off.on and calls(off, A, 0, 100 * MIB, 10)[1] == [None] * 10


@pytest.mark.parametrize(
    ("args", "says"), [((-1,), "leak_bytes"), ((1.5,), "leak_bytes"), ((1, -1), "warm_calls")]
)
def test_bad_settings_name_the_field(args: tuple[object, ...], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        LeakWatch(*args)  # type: ignore[arg-type]
