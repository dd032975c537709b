"""A pool's ledger of loads across its replicas, without Ray: a load whose replica died counts
as failed, repeated deaths quarantine the part for the whole pool with back-off, a successful
load clears the count, and bad input changes nothing."""

from __future__ import annotations

import pytest

from ipnext.policy.load_ledger import LoadLedger
from ipnext.policy.pool_cache import PartKey

pytestmark = pytest.mark.timeout(60)

BAD = PartKey("alpha", "embed", "s2")
GOOD = PartKey("beta", "embed", "s1")


def test_a_part_whose_loads_kill_their_replicas_is_quarantined_for_the_pool() -> None:
    ledger = LoadLedger(max_failures=2, quarantine_s=10)
    assert ledger.begin(BAD, "r1", 0.0).allowed and ledger.begin(GOOD, "r1", 0.0).allowed
    ledger.end(GOOD, "r1", None, 0.5)
    assert ledger.replica_gone("r1", 1.0) == [BAD]  # r1 died with BAD's load under way
    assert ledger.begin(BAD, "r2", 2.0).allowed  # one death: tried again, on the new replica
    assert ledger.replica_gone("r2", 3.0) == [BAD]
    refused = ledger.begin(BAD, "r3", 4.0)
    assert not refused.allowed and refused.until == 13.0
    assert "died while loading it" in refused.reason
    assert ledger.begin(GOOD, "r3", 4.0).allowed  # its pool-mates load as ever
    assert ledger.begin(BAD, "r3", 13.5).allowed  # the quarantine ended
    ledger.end(BAD, "r3", "boom", 14.0)
    ledger.end(BAD, "r3", None, 14.0)  # not under way any more: ignored
    assert ledger.begin(BAD, "r4", 15.0).allowed
    ledger.end(BAD, "r4", "boom again", 16.0)
    again = ledger.begin(BAD, "r5", 17.0)
    assert not again.allowed and again.until == 16.0 + 20.0  # the repeat doubles it


def test_a_successful_load_clears_the_count_and_reports_after_a_death_are_ignored() -> None:
    ledger = LoadLedger(max_failures=2)
    ledger.begin(BAD, "r1", 0.0)
    ledger.end(BAD, "r1", "raised", 1.0)
    ledger.begin(BAD, "r1", 2.0)
    ledger.end(BAD, "r1", None, 3.0)  # loaded: the failure before it is forgotten
    ledger.begin(BAD, "r1", 4.0)
    assert ledger.replica_gone("r1", 5.0) == [BAD]
    ledger.end(BAD, "r1", "late report", 6.0)  # its death already counted it
    assert ledger.quarantined(7.0) == {} and ledger.begin(BAD, "r2", 7.0).allowed
    assert ledger.loading() == {BAD: {"r2": 7.0}}


def test_calls_that_kill_their_replicas_quarantine_the_part_and_a_new_load_does_not_clear_them() -> None:
    ledger = LoadLedger(max_failures=2, quarantine_s=10)
    assert ledger.begin(BAD, "r1", 0.0).allowed
    ledger.end(BAD, "r1", None, 0.5)  # loaded
    assert ledger.begin(BAD, "r1", 1.0, "call").allowed and ledger.begin(GOOD, "r1", 1.0, "call").allowed
    ledger.end(GOOD, "r1", None, 1.2, "call")
    assert ledger.replicas_under_way() == {"r1": 1.0}
    assert ledger.replica_gone("r1", 2.0) == [BAD]  # died running BAD's call
    assert ledger.begin(BAD, "r2", 3.0).allowed
    ledger.end(BAD, "r2", None, 3.5)  # loaded again on the new replica: the death still counts
    assert ledger.begin(BAD, "r2", 4.0, "call").allowed
    assert ledger.replica_gone("r2", 5.0) == [BAD]
    refused = ledger.begin(BAD, "r3", 6.0)
    assert not refused.allowed and refused.until == 15.0
    assert refused.reason == "call failed 2 times in a row; last: its replica died while running it"
    assert not ledger.begin(BAD, "r3", 6.0, "call").allowed
    assert ledger.begin(GOOD, "r3", 6.0).allowed  # its pool-mates load as ever
    assert ledger.loading() == {GOOD: {"r3": 6.0}}


def test_a_call_that_ends_clears_the_call_deaths_before_it() -> None:
    ledger = LoadLedger(max_failures=2)
    ledger.begin(BAD, "r1", 0.0, "call")
    ledger.replica_gone("r1", 1.0)
    ledger.begin(BAD, "r2", 2.0, "call")
    ledger.end(BAD, "r2", None, 3.0, "call")  # ran: the death before it is forgotten
    ledger.begin(BAD, "r2", 4.0, "call")
    ledger.replica_gone("r2", 5.0)
    assert ledger.quarantined(6.0) == {} and ledger.begin(BAD, "r3", 6.0, "call").allowed


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda ledger: ledger.begin(("alpha", "embed", "s1"), "r1", 0.0), "key: .* no PartKey"),
        (lambda ledger: ledger.begin(BAD, "", 0.0), "replica: ''"),
        (lambda ledger: ledger.replica_gone(None, 0.0), "replica: None"),
        (lambda ledger: ledger.begin(BAD, "r1", 0.0, "predict"), "kind: 'predict'; give one of load, call"),
        (lambda ledger: LoadLedger(max_failures=0), "max_failures: 0"),
        (lambda ledger: LoadLedger(quarantine_s=float("inf")), "quarantine_s: inf"),
    ],
)
def test_bad_input_names_the_field_and_changes_nothing(call: object, says: str) -> None:
    ledger = LoadLedger()
    with pytest.raises(ValueError, match=says):
        call(ledger)  # type: ignore[operator]
    assert ledger.loading() == {} and ledger.quarantined(0.0) == {}


def test_a_part_one_replica_saw_leaking_is_refused_by_every_replica_with_back_off() -> None:
    ledger = LoadLedger(max_failures=2, quarantine_s=10)
    assert ledger.quarantine(BAD, "leaks memory: 300 MiB over 40 lone calls", 5.0) == 15.0
    refused = ledger.begin(BAD, "r2", 6.0)
    assert not refused.allowed and "leaks memory" in refused.reason
    assert ledger.begin(GOOD, "r2", 6.0).allowed
    assert ledger.quarantine(BAD, "leaks memory again", 20.0) == 40.0  # the repeat doubles it
    with pytest.raises(ValueError, match="reason"):
        ledger.quarantine(BAD, "", 21.0)
