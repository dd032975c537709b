"""Admission by time (`ipnext.policy.admission`): a request is to be shed when its expected queue
wait exceeds the model's `router.max_queue_wait_ms` or what its own deadline leaves; a burst
passing through, a queue that drains, and a router without history shed nothing. The history is
given on an explicit clock, so no result depends on how fast this runs. The router's side (503,
Retry-After, counted as shed) is in test_router_doors."""

from __future__ import annotations

import pytest

from ipnext.policy.admission import Admission, QueueDelay, retry_after_seconds


def served(queue: QueueDelay, start: float, latency: float, completed: bool = True) -> None:
    queue.finished(queue.started(start), start + latency, completed)


def test_without_history_nothing_is_shed() -> None:
    queue = QueueDelay(interval_s=0.5, base_window_s=30.0)
    assert queue.admit(100.0, max_wait_s=0.001, deadline_s=0.001) == Admission(False, 0.0, 0.001)
    queue.started(50.0)  # in flight since long ago, but no service time known yet: nothing to hold it to
    assert not queue.admit(100.0, 0.001, None).shed


def test_a_passing_burst_is_not_shed() -> None:
    queue = QueueDelay(interval_s=0.5, base_window_s=30.0)
    served(queue, 0.0, 0.010)  # the service time: 10 ms
    # Some requests of the last interval waited, but one went straight through: no queue stands.
    for start, latency in ((9.0, 0.30), (9.1, 0.012), (9.2, 0.25)):
        served(queue, start, latency)
    for _ in range(50):
        queue.started(9.5)
    burst = queue.admit(9.6, max_wait_s=0.1, deadline_s=30.0)
    assert not burst.shed and burst.expected_wait_s == pytest.approx(0.002)


def saturated(in_flight: int) -> QueueDelay:
    """A router serving 50 requests/s for the last 2 s, each after 290 ms in the queue (a queue
    that stands), with `in_flight` requests admitted and not answered yet."""
    queue = QueueDelay(interval_s=0.5, base_window_s=30.0, rate_window_s=2.0)
    served(queue, 0.0, 0.010)  # the service time: 10 ms
    for k in range(100):
        done = 8.72 + 0.02 * k
        served(queue, done - 0.30, 0.30)
    for _ in range(in_flight):
        queue.started(10.6)
    return queue


def test_while_a_queue_stands_what_is_admitted_follows_the_rate_it_drains_at() -> None:
    """At 50/s with a 10 ms service time and a 100 ms budget, about 5 requests may be in flight
    (50 x 0.11); the next one would wait past its budget and is shed, at once."""
    few = saturated(in_flight=4).admit(10.7, max_wait_s=0.1, deadline_s=30.0)
    assert not few.shed and few.expected_wait_s == pytest.approx(4 / 50 - 0.010)
    many = saturated(in_flight=20).admit(10.7, max_wait_s=0.1, deadline_s=30.0)
    assert many.shed and many.expected_wait_s == pytest.approx(20 / 50 - 0.010) and many.budget_s == 0.1
    assert retry_after_seconds(many, 1) == 1 and retry_after_seconds(many, 5) == 5
    # Its own deadline binds when it is the smaller budget; a generous one admits.
    assert saturated(in_flight=20).admit(10.7, None, deadline_s=0.2).shed
    assert not saturated(in_flight=20).admit(10.7, None, deadline_s=5.0).shed
    # The queue drained: the requests of the next interval went straight through.
    drained = saturated(in_flight=20)
    served(drained, 11.0, 0.011)
    assert not drained.admit(11.2, 0.1, 30.0).shed


def test_a_queue_that_does_not_drain_is_read_from_its_oldest_request() -> None:
    queue = QueueDelay(interval_s=0.5, base_window_s=30.0)
    served(queue, 0.0, 0.010)
    queue.started(20.0)  # in flight, nothing completed since: nothing drains
    waiting = queue.admit(22.0, max_wait_s=1.0, deadline_s=None)
    assert waiting.shed and waiting.expected_wait_s == pytest.approx(1.99)
    assert retry_after_seconds(waiting, 1) == 1


def test_failures_teach_nothing_and_the_service_time_follows_the_window() -> None:
    queue = QueueDelay(interval_s=0.5, base_window_s=30.0)
    served(queue, 0.0, 0.001, completed=False)  # a fast failure is not a service time
    assert queue.service_s(1.0) is None
    served(queue, 1.0, 0.020)
    served(queue, 40.0, 0.050)  # the 20 ms one left the 30 s window
    assert queue.service_s(40.1) == pytest.approx(0.050)
    with pytest.raises(ValueError, match="interval_s"):
        QueueDelay(interval_s=0.0)
    with pytest.raises(ValueError, match="rate_window_s"):
        QueueDelay(rate_window_s=0.0)


def test_once_a_queue_stood_the_capacity_it_showed_bounds_what_is_admitted() -> None:
    """Reading the queue from completed latencies alone lags by a latency: when the least delayed
    request of the interval went through, every arrival was admitted until the queue stood again
    (bench/overload.py: p99 3.3 s). Once a queue has stood, the rate it drained at bounds what is
    in flight, whatever the latest latencies say, for the capacity window."""
    queue = saturated(in_flight=20)
    assert queue.admit(10.7, max_wait_s=0.1, deadline_s=30.0).shed  # stands: capacity 50/s learned
    assert queue.capacity(10.7) == pytest.approx(50.0)
    served(queue, 11.0, 0.011)  # one went straight through; 20 are still in flight
    assert queue.standing_s(11.2) == pytest.approx(0.001)
    behind = queue.admit(11.2, max_wait_s=0.1, deadline_s=30.0)
    assert behind.shed and behind.expected_wait_s == pytest.approx(20 / 50 - 0.010)
    assert queue.capacity(10.7 + 61) is None  # no queue stood for the capacity window: forgotten


def test_before_a_queue_stood_the_plans_capacity_bounds_a_first_burst() -> None:
    """A router that never saw its queue stand knows its capacity from the plan (the set's
    slowest part: replicas times declared qps): a first burst beyond what that serves within the
    budget is shed, not admitted whole to wait seconds."""
    queue = QueueDelay()
    served(queue, 0.0, 0.200)  # the service time: 200 ms
    for _ in range(3):
        queue.started(1.0)
    assert not queue.admit(1.01, max_wait_s=0.1, deadline_s=30.0, planned=10.0).shed  # 3 / 10 - 0.2
    for _ in range(10):
        queue.started(1.0)
    burst = queue.admit(1.01, max_wait_s=0.1, deadline_s=30.0, planned=10.0)
    assert burst.shed and burst.expected_wait_s == pytest.approx(13 / 10 - 0.2)
    assert not queue.admit(1.01, max_wait_s=0.1, deadline_s=30.0).shed  # no plan, no queue seen: admitted
    assert not queue.admit(1.01, max_wait_s=None, deadline_s=30.0, planned=10.0).shed  # 30 s allows it


def test_a_request_past_its_deadline_stands_for_no_queue() -> None:
    """A request the router gave up on at its deadline is no longer in flight, whether or not its
    `finished` came (a leaked one, never finished, once read as a queue that grew with its age,
    and every request was shed from then on: a lost region's drill saw waits of 43 s, then 85 s)."""
    queue = QueueDelay(interval_s=0.5, base_window_s=30.0)
    served(queue, 0.0, 0.010)
    queue.started(20.0, deadline_s=5.0)  # never finished
    assert queue.in_flight(24.0) == 1 and queue.admit(24.0, max_wait_s=1.0, deadline_s=5.0).shed
    assert queue.in_flight(25.5) == 0
    assert queue.admit(25.5, max_wait_s=1.0, deadline_s=5.0) == Admission(False, 0.0, 1.0)
    done = queue.started(30.0, deadline_s=5.0)
    queue.finished(done, 30.02)  # finished in time: learned from, and gone from the heap's view
    assert queue.in_flight(30.1) == 0 and queue.service_s(30.1) == pytest.approx(0.020)
    assert queue.in_flight(40.0) == 0  # its expiry passing later changes nothing
