"""The shared vocabulary: ids built and parsed in one place, status predicates, and the two
polling helpers' contract (the value once done, else a timeout carrying the last value)."""

from __future__ import annotations

import itertools

import pytest

from ipnext.contracts.rollout import RolloutResult
from ipnext.names import (
    PollTimeoutError,
    RolloutOutcome,
    RolloutState,
    SetStatus,
    model_name_of,
    model_workflow_id,
    poll_until,
    wait_until,
)


def test_a_model_id_round_trips_and_other_ids_are_refused() -> None:
    assert model_name_of(model_workflow_id("feed-ranker")) == "feed-ranker"
    for bad in ("rollout/feed-ranker/feed-ranker@2", "model/", "feed-ranker"):
        with pytest.raises(ValueError, match="not a model workflow id"):
            model_name_of(bad)


def test_status_predicates() -> None:
    assert {s for s in RolloutState if not s.is_terminal} == {
        RolloutState.PENDING,
        RolloutState.RUNNING,
        RolloutState.PAUSED,
    }
    assert {s for s in RolloutState if s.is_live} == {RolloutState.RUNNING, RolloutState.PAUSED}
    assert not SetStatus.SERVING.never_serves and not SetStatus.RETIRED.never_serves
    assert SetStatus.ROLLED_BACK.never_serves and SetStatus("refused").never_serves
    # A rollout's end state names the set's status the same way (ModelWorkflow maps one to the other).
    for state in RolloutState:
        if state.is_terminal and state != RolloutState.COMPLETED:
            assert SetStatus(state.value).never_serves
    # Every end state names an outcome (a rollout's result says how it ended); a live one none.
    assert {RolloutOutcome.of(s) for s in RolloutState if s.is_terminal} == set(RolloutOutcome)
    assert all(RolloutOutcome.of(s) is None for s in RolloutState if not s.is_terminal)


def test_a_result_recorded_before_outcomes_existed_reads_its_outcome_from_its_state() -> None:
    old = {"state": "rolled_back", "apps": {"us-east": "app-1"}, "generations": [2, 3]}
    assert RolloutResult.model_validate(old).outcome == RolloutOutcome.ROLLED_BACK
    with pytest.raises(ValueError):  # a live state is no end: no result carries it
        RolloutResult.model_validate({**old, "state": "running"})


async def test_poll_until_returns_the_value_once_done_and_times_out_with_the_last() -> None:
    counter = itertools.count()

    async def read() -> int:
        return next(counter)

    assert await poll_until(read, lambda n: n >= 3, timeout_s=5, interval_s=0) == 3
    with pytest.raises(PollTimeoutError, match=r"never: not reached within 0\.05 s") as err:
        await poll_until(read, lambda n: n < 0, timeout_s=0.05, interval_s=0.01, what="never")
    assert isinstance(err.value.last, int) and err.value.last > 3


def test_wait_until_is_the_same_contract_without_a_loop() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter), lambda n: n >= 3, timeout_s=5, interval_s=0) == 3
    with pytest.raises(PollTimeoutError) as err:
        wait_until(lambda: next(counter), lambda n: n < 0, timeout_s=0.05, interval_s=0.01)
    assert isinstance(err.value.last, int)


def test_an_error_in_read_or_done_propagates_at_once() -> None:
    def done(_: int) -> bool:
        raise RuntimeError("the rollout failed: stop waiting")

    with pytest.raises(RuntimeError, match="stop waiting"):
        wait_until(lambda: 1, done, timeout_s=60)
