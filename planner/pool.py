"""Solving many blocks at once: in worker processes (spawned, each holding the instance) when
there are enough blocks, else in this process, always within a deadline."""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from multiprocessing import get_context

import numpy as np

from ipnext.errors import PlanningTimeoutError
from ipnext.planner.block.common import WORK_BUDGET
from ipnext.planner.instance import Instance
from ipnext.planner.pricing import BlockChoice, block_names, place_jointly, solve_block

__all__ = ["BLOCK_TIME_LIMIT_S", "Jobs", "Pool", "gather", "place_jointly_in_worker"]

BLOCK_TIME_LIMIT_S = 0.25  # per block while the prices move; HiGHS's bound at the limit is still valid
RETRY_TIME_LIMIT_S = 10.0  # a block that found no placement at all in BLOCK_TIME_LIMIT_S
PARALLEL_MIN_BLOCKS = 64

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
    args: tuple[list[int], np.ndarray, float, float, bool, int],
) -> list[BlockChoice | None]:
    assert _WORKER_INST is not None  # set by the pool initializer
    blocks, prices, churn, limit, refine, work = args
    return [solve_block(_WORKER_INST, b, prices, churn, limit, refine=refine, work=work) for b in blocks]


def place_jointly_in_worker(
    args: tuple[list[int], np.ndarray, float, float],
) -> dict[int, BlockChoice] | None:
    assert _WORKER_INST is not None  # set by the pool initializer
    return place_jointly(_WORKER_INST, *args)


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
        limit_s: float,
        refine: bool,
        size: int,
        work: int = WORK_BUDGET,
    ) -> Jobs:
        """Send `blocks` to the workers, `size` to a chunk, without waiting (see gather)."""
        assert self.executor is not None
        return {
            self.executor.submit(
                _solve_blocks_in_worker, (blocks[i : i + size], prices, churn, limit_s, refine, work)
            ): blocks[i : i + size]
            for i in range(0, len(blocks), size)
        }

    def solve(
        self,
        blocks: list[int],
        prices: np.ndarray,
        churn: float,
        limit_s: float = BLOCK_TIME_LIMIT_S,
        *,
        refine: bool = True,
        deadline: float = math.inf,
        work: int = WORK_BUDGET,
    ) -> dict[int, BlockChoice]:
        """Every block of `blocks` priced at `prices`; past `deadline` the blocks not yet
        answered are left out of the result (the caller keeps their earlier columns and
        bounds), so a round at fleet scale never runs over the planner's time limit. `work`
        is the fast block solver's budget per block."""
        results: dict[int, BlockChoice | None] = {}
        if self.executor is None or len(blocks) < 2 * self.workers:
            for b in blocks:
                if time.monotonic() > deadline:
                    break
                results[b] = solve_block(self.inst, b, prices, churn, limit_s, refine=refine, work=work)
        else:
            # Small chunks: a deadline drops only what is unfinished, and HiGHS solves (seconds
            # each) go one block to a chunk.
            size = 1 if refine and limit_s >= 1.0 else max(4, math.ceil(len(blocks) / (self.workers * 32)))
            results = gather(self.submit(blocks, prices, churn, limit_s, refine, size, work), deadline)
        out = {}
        for b, choice in results.items():
            if choice is None and time.monotonic() < deadline:
                # No placement found yet (not infeasible: that raised already).
                choice = solve_block(self.inst, b, prices, churn, RETRY_TIME_LIMIT_S)
            if choice is None:
                if deadline < math.inf:
                    continue
                raise PlanningTimeoutError(
                    f"{block_names(self.inst, b)}: the block solver found no placement in {RETRY_TIME_LIMIT_S:g} s.",
                    fix="give the planner more time (--time-limit)",
                )
            out[b] = choice
        return out


def gather(jobs: Jobs, deadline: float) -> dict[int, BlockChoice | None]:
    """The answers of the chunks that finished by `deadline`; the others are dropped (one
    already running finishes in its worker)."""
    timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
    done, pending = wait(jobs, timeout=timeout)
    for future in pending:
        future.cancel()
    # In the order the chunks were sent, never the order they finished in: the master LP takes
    # the columns in this order, and its ties would otherwise break differently run to run.
    results: dict[int, BlockChoice | None] = {}
    for future, blocks in jobs.items():
        if future in done:
            results.update(zip(blocks, future.result(), strict=True))
    return results
