"""The feedback ledger (`ipnext.store.feedback_ledger`): a (request id, outcome) is new once,
seen after; ids past the window are refused and forgotten; a full ledger refuses and records
nothing; a ledger read back from its log refuses what was counted; a line cut short by a crash
is skipped; the log is rewritten without expired ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipnext.store.feedback_ledger import COMPACT_MIN, Claim, FeedbackLedger, LedgerFullError


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_each_pair_is_new_once_and_an_old_id_is_refused(tmp_path: Path) -> None:
    clock = Clock()
    ledger = FeedbackLedger(tmp_path / "e.log", window_seconds=60.0, max_entries=10, clock=clock)
    assert ledger.claim("id-1", clock.now, ["click"]) == {"click": Claim.NEW}
    assert ledger.claim("id-1", clock.now, ["click", "buy"]) == {"click": Claim.SEEN, "buy": Claim.NEW}
    assert ledger.claim("id-1", clock.now, ["buy", "buy"]) == {"buy": Claim.SEEN}
    assert ledger.claim("id-2", clock.now, ["click"]) == {"click": Claim.NEW}
    assert ledger.claim("id-3", clock.now - 61, ["click"]) == {"click": Claim.EXPIRED}
    clock.now += 61  # id-1 and id-2 are past the window: refused, and forgotten at the next sweep
    assert ledger.claim("id-1", clock.now - 61, ["click"]) == {"click": Claim.EXPIRED}
    assert len(ledger) == 3 and ledger.sweep() == 3 and len(ledger) == 0


def test_a_full_ledger_refuses_and_records_nothing_until_ids_expire(tmp_path: Path) -> None:
    clock = Clock()
    ledger = FeedbackLedger(tmp_path / "e.log", window_seconds=60.0, max_entries=3, clock=clock)
    ledger.claim("a", clock.now, ["x", "y"])
    with pytest.raises(LedgerFullError, match=r"feedback\.max_entries 3"):
        ledger.claim("b", clock.now, ["x", "y"])
    assert len(ledger) == 2  # all or nothing
    assert ledger.claim("b", clock.now, ["x"]) == {"x": Claim.NEW}
    clock.now += 61
    assert ledger.claim("c", clock.now, ["x", "y"]) == {"x": Claim.NEW, "y": Claim.NEW}  # room again


def test_a_ledger_read_back_from_its_log_refuses_what_was_counted(tmp_path: Path) -> None:
    clock = Clock()
    log = tmp_path / "feedback" / "m" / "e.log"
    ledger = FeedbackLedger(log, window_seconds=60.0, max_entries=10, clock=clock)
    ledger.claim("a", clock.now, ["click"])
    ledger.claim("b", clock.now - 30, ["click"])
    with log.open("a") as out:
        out.write("0123abc")  # a line cut short by a crash: its claim was never answered
    again = FeedbackLedger(log, window_seconds=60.0, max_entries=10, clock=clock)
    assert again.claim("a", clock.now, ["click"]) == {"click": Claim.SEEN}
    assert again.claim("b", clock.now - 30, ["click"]) == {"click": Claim.SEEN}
    clock.now += 40  # b's id has expired: a ledger started now does not keep it
    assert len(FeedbackLedger(log, window_seconds=60.0, max_entries=10, clock=clock)) == 1


def test_the_log_is_rewritten_without_expired_ids(tmp_path: Path) -> None:
    clock = Clock()
    log = tmp_path / "e.log"
    ledger = FeedbackLedger(log, window_seconds=60.0, max_entries=10 * COMPACT_MIN, clock=clock)
    for n in range(COMPACT_MIN + 10):
        ledger.claim(f"old-{n}", clock.now, ["click"])
    clock.now += 61
    ledger.claim("new", clock.now, ["click"])
    assert ledger.sweep() == COMPACT_MIN + 10
    assert log.read_text().count("\n") == 1  # only the live one
    assert FeedbackLedger(log, 60.0, 10, clock=clock).claim("new", clock.now, ["click"]) == {
        "click": Claim.SEEN
    }
    ledger.forget_all()
    assert not log.exists() and len(ledger) == 0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        FeedbackLedger(None, window_seconds=0.0, max_entries=1)
