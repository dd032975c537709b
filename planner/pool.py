"""Solving many blocks at once: in worker processes (spawned, each holding the instance) when
there are enough blocks, else in this process, always within a work budget: the answers are
charged in the order the blocks were given, never the order they arrived in, so the blocks a
budget reaches are the same however many workers there are and however fast they ran."""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing import get_context

import numpy as np

from ipnext.errors import PlanningTimeoutError
from ipnext.planner.block.common import WORK_BUDGET
from ipnext.planner.instance import Instance
from ipnext.planner.pricing import BlockChoice, block_names, place_jointly, solve_block
from ipnext.planner.work import UNITS_PER_SECOND, Budget, Clock

__all__ = ["BLOCK_MIP_WORK", "Jobs", "Pool", "gather", "place_jointly_in_worker"]

# Per block while the prices move (once 0.25 s); HiGHS's bound at its limit is still valid.
BLOCK_MIP_WORK = UNITS_PER_SECOND // 4
RETRY_MIP_WORK = 10 * UNITS_PER_SECOND  # a block that found no placement at all in BLOCK_MIP_WORK
PARALLEL_MIN_BLOCKS = 64
IN_FLIGHT_PER_WORKER = 4  # chunks sent ahead of the one being taken

_WORKER_INST: Instance | None = None


# How often a worker looks whether the planner process that started it is still there.
PARENT_CHECK_S = 1.0


def _init_worker(inst: Instance, parent: int) -> None:
    global _WORKER_INST
    _WORKER_INST = inst
    threading.Thread(target=_exit_without, args=(parent,), name="parent-watch", daemon=True).start()


def _exit_without(parent: int) -> None:
    """End this worker once the planner process that started it is gone: killed mid-solve, it
    never ran the pool's exit, and its workers lived on, waiting on a queue no one writes to
    (two still alive 11 minutes after a SIGTERM)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def _solve_blocks_in_worker(
    args: tuple[list[int], np.ndarray, float, int, bool, int, Clock],
) -> list[BlockChoice | None]:
    assert _WORKER_INST is not None  # set by the pool initializer
    blocks, prices, churn, mip_work, refine, work, clock = args
    return [
        solve_block(_WORKER_INST, b, prices, churn, mip_work, refine=refine, work=work, clock=clock)
        for b in blocks
    ]


def place_jointly_in_worker(
    args: tuple[list[int], np.ndarray, float, Budget],
) -> tuple[dict[int, BlockChoice] | None, int]:
    """`place_jointly` in a worker, with the work it spent (the caller charges it)."""
    assert _WORKER_INST is not None  # set by the pool initializer
    movers, residual, churn, budget = args
    placed = place_jointly(_WORKER_INST, movers, residual, churn, budget)
    return placed, budget.spent


Jobs = dict[Future[list[BlockChoice | None]], list[int]]  # a chunk's future -> its blocks


class Pool:
    """Solves many blocks, in worker processes when there are enough of them."""

    def __init__(self, inst: Instance, workers: int) -> None:
        self.inst = inst
        self.workers = workers
        self.executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> Pool:
        if self.workers > 1 and len(self.inst.blocks) >= PARALLEL_MIN_BLOCKS:
            self.executor = ProcessPoolExecutor(
                self.workers,
                mp_context=get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.inst, os.getpid()),
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.executor is not None:
            # Chunks still running past a deadline would hold both cores (and shutdown would
            # wait for them) while the plan is built: stop the workers instead. Then wait for
            # them and for the executor's manager thread, which holds the queues (and their
            # semaphores) until it sees its workers gone: left running, they were still alive
            # at exit ("resource_tracker: There appear to be 5 leaked semaphore objects").
            processes = list((getattr(self.executor, "_processes", None) or {}).values())
            manager = getattr(self.executor, "_executor_manager_thread", None)
            self.executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            for process in processes:
                process.join(timeout=10)
            if manager is not None:
                manager.join(timeout=10)
            self.executor = None

    def submit(
        self,
        blocks: list[int],
        prices: np.ndarray,
        churn: float,
        mip_work: int,
        refine: bool,
        size: int,
        work: int = WORK_BUDGET,
        clock: Clock | None = None,
    ) -> Jobs:
        """Send `blocks` to the workers, `size` to a chunk, without waiting (see gather)."""
        assert self.executor is not None
        clock = clock or Clock()
        return {
            self.executor.submit(
                _solve_blocks_in_worker, (blocks[i : i + size], prices, churn, mip_work, refine, work, clock)
            ): blocks[i : i + size]
            for i in range(0, len(blocks), size)
        }

    def solve(
        self,
        blocks: list[int],
        prices: np.ndarray,
        churn: float,
        mip_work: int = BLOCK_MIP_WORK,
        *,
        budget: Budget | None = None,
        refine: bool = True,
        work: int = WORK_BUDGET,
    ) -> dict[int, BlockChoice]:
        """Every block of `blocks` priced at `prices`, each charged to `budget` in the order
        given; once it is spent the blocks after are left out of the result (the caller keeps
        their earlier columns and bounds), so a round at fleet scale stays in its budget, and
        the blocks it reaches depend on the work alone. `work` is the fast block solver's
        budget per block, `mip_work` the MIP's. The outer clock, when it fires, also leaves
        out what is unanswered. Without a budget, a block with no placement raises."""
        ledger = budget if budget is not None else Budget(1 << 62)
        if ledger.exhausted():
            return {}

        def answers() -> Iterator[tuple[int, BlockChoice | None]]:
            if self.executor is None or len(blocks) < 2 * self.workers:
                for b in blocks:
                    yield (
                        b,
                        solve_block(
                            self.inst,
                            b,
                            prices,
                            churn,
                            mip_work,
                            refine=refine,
                            work=work,
                            clock=ledger.clock,
                        ),
                    )
                return
            # Small chunks, a few per worker in flight, taken in the order sent: once the
            # blocks taken have spent the budget the rest are cancelled (the blocks kept are
            # the same as in this process), and HiGHS solves (seconds each) go one to a chunk.
            long = refine and mip_work >= UNITS_PER_SECOND
            size = 1 if long else max(4, math.ceil(len(blocks) / (self.workers * 32)))
            chunks = [blocks[i : i + size] for i in range(0, len(blocks), size)]
            flying: deque[tuple[Future[list[BlockChoice | None]], list[int]]] = deque()
            sent = 0
            try:
                while sent < len(chunks) or flying:
                    while sent < len(chunks) and len(flying) < IN_FLIGHT_PER_WORKER * self.workers:
                        args = (chunks[sent], prices, churn, mip_work, refine, work, ledger.clock)
                        flying.append((self.executor.submit(_solve_blocks_in_worker, args), chunks[sent]))
                        sent += 1
                    future, chunk = flying.popleft()
                    try:
                        found = future.result(timeout=_until(ledger.clock))
                    except FutureTimeout:
                        ledger.clock.fired = True
                        return
                    yield from zip(chunk, found, strict=True)
            finally:
                for future, _ in flying:
                    future.cancel()

        out: dict[int, BlockChoice] = {}
        for b, choice in answers():
            if choice is None:
                ledger.spend(work + mip_work)  # what the call that found nothing was allowed
                if not ledger.exhausted():
                    # No placement found yet (not infeasible: that raised already).
                    choice = solve_block(self.inst, b, prices, churn, RETRY_MIP_WORK, ledger=ledger)
            else:
                ledger.spend(choice.work)
            if choice is None and budget is None:
                raise PlanningTimeoutError(
                    f"{block_names(self.inst, b)}: the block solver found no placement in "
                    f"{RETRY_MIP_WORK:,} work units.",
                    fix="give the planner more work (--work-limit)",
                )
            if choice is not None:
                out[b] = choice
            if ledger.exhausted():
                break
        return out


def gather(jobs: Jobs, clock: Clock | None = None) -> dict[int, BlockChoice | None]:
    """The answers of every chunk (work-limited, so each ends), or of those that finished by
    the outer `clock`; the others are dropped (one already running finishes in its worker)."""
    done, pending = wait(jobs, timeout=_until(clock))
    for future in pending:
        future.cancel()
    if pending and clock is not None:
        clock.fired = True
    # In the order the chunks were sent, never the order they finished in: the master LP takes
    # the columns in this order, and its ties would otherwise break differently run to run.
    results: dict[int, BlockChoice | None] = {}
    for future, blocks in jobs.items():
        if future in done:
            results.update(zip(blocks, future.result(), strict=True))
    return results


def _until(clock: Clock | None) -> float | None:
    """Seconds to the outer stop, for a wait (None: no stop)."""
    if clock is None or clock.deadline == math.inf:
        return None
    return max(0.0, clock.deadline - time.monotonic())
