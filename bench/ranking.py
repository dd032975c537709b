"""Request-oriented ranking against the naive per-pair path, both measured in the same run.

    .venv/bin/python bench/ranking.py [--candidates 100 500 1000] [--repeats 5] [--no-serving]

1. The model, in this process, at the issue's sizes (a 256-event history through the user tower,
   embedding dim 64; RankingConfig's defaults), random weights with a fixed seed. For each
   candidate count: the median time of `score_request` (the user tower once, broadcast to the
   candidates) and of `score_pairs` (every pair runs the whole model), their ratio, and the
   theoretical ratio from FLOPs counted by torch's FlopCounterMode: U = the user tower's FLOPs
   (its lookups are free), C = the per-candidate FLOPs ((request FLOPs - U) / n), naive FLOPs =
   n (U + C), request FLOPs = U + n C, theoretical = n (U + C) / (U + n C). Each path's achieved
   GFLOP/s says why the measured ratio and the FLOP ratio differ.
2. Serving (unless --no-serving), on a dev stack of its own: the same weights published as two
   models, `bench-ranking` (dense part RankerPart) and `bench-ranking-naive` (PairRankerPart),
   each one table replica and one dense replica (one torch thread each, as every part host runs);
   open-loop requests at a fixed rate (--rate, --seconds, --serve-candidates) through the router
   over HTTP, latency from each request's scheduled send time (so queueing counts), p50/p99 per path.
3. The router's bound on requests in flight (unless --no-serving), on the same stack: the
   request-oriented model published twice more, once with the router's `max_ongoing_requests` at
   Serve's default of 5 (the bound every router had before RouterSpec) and once at RouterSpec's
   default of 100, each under a closed loop of --concurrency callers for --seconds: answered
   requests per second, p50/p99, and the dense part's mean batch (calls / batches, from its
   `describe()`); the ratio of the two throughputs.

Prints each figure as it is measured and writes bench/results/ranking.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ipnext.examples.request_ranker.model import RankingConfig, RankingModel
from ipnext.store.keys import key_header

REPO = Path(__file__).resolve().parents[1]


def bench_model(seed: int = 0) -> RankingModel:
    torch.manual_seed(seed)
    model = RankingModel(RankingConfig()).eval()
    with torch.no_grad():
        model.item_features.normal_()
        model.item_category.random_(0, model.config.num_categories)
    return model


def flops(fn: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def timed(fn: Any, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_model(counts: list[int], repeats: int) -> dict[str, Any]:
    model = bench_model()
    c = model.config
    rng = random.Random(1)
    user = torch.tensor([rng.randrange(c.num_users)])
    history = torch.tensor([rng.randrange(c.num_items) for _ in range(c.seq_len)])
    features = torch.randn(c.user_features)
    print(
        f"model: {c.seq_len}-event history, dim {c.dim}, {c.heads} heads, experts {list(c.experts)}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        user_tower = flops(
            lambda: model.user_tower(
                model.lookup_users(user), model.lookup_items(history).unsqueeze(0), features.view(1, -1)
            )
        )
        for n in counts:
            candidates = torch.tensor([rng.randrange(c.num_items) for _ in range(n)])
            args = (user, history, features, candidates)
            request_flops = flops(lambda args=args: model.score_request(*args))
            naive_flops = flops(lambda args=args: model.score_pairs(*args))
            per_candidate = (request_flops - user_tower) / n
            theoretical = n * (user_tower + per_candidate) / (user_tower + n * per_candidate)
            request_s = timed(lambda args=args: model.score_request(*args), repeats * 4)
            naive_s = timed(lambda args=args: model.score_pairs(*args), repeats)
            speedup = naive_s / request_s
            row = {
                "candidates": n,
                "request_ms": round(request_s * 1000, 3),
                "naive_ms": round(naive_s * 1000, 1),
                "speedup": round(speedup, 1),
                "user_tower_mflop": round(user_tower / 1e6, 3),
                "per_candidate_mflop": round(per_candidate / 1e6, 4),
                "request_mflop": round(request_flops / 1e6, 1),
                "naive_mflop": round(naive_flops / 1e6, 1),
                "theoretical_speedup": round(theoretical, 1),
                "speedup_over_theoretical": round(speedup / theoretical, 2),
                "request_gflops_per_s": round(request_flops / request_s / 1e9, 1),
                "naive_gflops_per_s": round(naive_flops / naive_s / 1e9, 1),
            }
            rows.append(row)
            print(
                f"{n:5d} candidates: request {row['request_ms']:.2f} ms, naive {row['naive_ms']:.1f} ms, "
                f"speedup {speedup:.1f}x; FLOPs U={row['user_tower_mflop']} M, "
                f"C={row['per_candidate_mflop']} M "
                f"-> theoretical {theoretical:.1f}x "
                f"(measured/theoretical {row['speedup_over_theoretical']}); "
                f"GFLOP/s request {row['request_gflops_per_s']}, naive {row['naive_gflops_per_s']}"
            )
    return {"threads": torch.get_num_threads(), "config": c.as_dict(), "rows": rows}


class Tally:
    """The answers and failures of one load run, and their summary."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.failures: list[str] = []

    async def post(self, http: Any, url: str, body: dict[str, Any], since: float) -> None:
        """Send one request; a right answer's latency counts from `since` (scheduled or sent)."""
        import httpx

        try:
            reply = await http.post(url, json={"inputs": body})
        except httpx.HTTPError as err:
            self.failures.append(f"{type(err).__name__}: {err}")
            return
        if reply.status_code != 200 or len(reply.json()["outputs"]) != len(body["candidates"]):
            self.failures.append(f"{reply.status_code}: {reply.text[:200]}")
            return
        self.latencies.append(time.perf_counter() - since)

    def summary(self) -> dict[str, Any]:
        latencies = sorted(self.latencies)
        pick = lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 1)  # noqa: E731
        return {
            "answered": len(latencies),
            "failed": len(self.failures),
            "failures": self.failures[:5],
            "p50_ms": pick(0.50) if latencies else None,
            "p99_ms": pick(0.99) if latencies else None,
        }


async def open_loop(
    url: str, requests: list[dict[str, Any]], rate: float, headers: dict[str, str]
) -> dict[str, Any]:
    """Send `requests` at `rate` per second whatever the answers do; latency from each scheduled send."""
    import httpx

    tally = Tally()
    async with httpx.AsyncClient(
        timeout=120, limits=httpx.Limits(max_connections=256), headers=headers
    ) as http:
        start = time.perf_counter() + 0.2

        async def one(i: int, body: dict[str, Any]) -> None:
            scheduled = start + i / rate
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            await tally.post(http, url, body, since=scheduled)

        await asyncio.gather(*(one(i, body) for i, body in enumerate(requests)))
    return {"requests": len(requests), **tally.summary()}


async def closed_loop(
    url: str, requests: list[dict[str, Any]], callers: int, seconds: float, headers: dict[str, str]
) -> dict[str, Any]:
    """`callers` callers, each sending its next request when the last one answered, for `seconds`."""
    import httpx

    tally = Tally()
    async with httpx.AsyncClient(
        timeout=120, limits=httpx.Limits(max_connections=callers + 8), headers=headers
    ) as http:
        start = time.perf_counter()
        stop = start + seconds

        async def caller(index: int) -> None:
            for i in itertools.count(index, callers):
                if time.perf_counter() >= stop:
                    return
                await tally.post(http, url, requests[i % len(requests)], since=time.perf_counter())

        await asyncio.gather(*(caller(i) for i in range(callers)))
        elapsed = time.perf_counter() - start
    summary = tally.summary()
    return {
        "callers": callers,
        "seconds": round(elapsed, 2),
        **summary,
        "per_s": round(summary["answered"] / elapsed, 1),
    }


async def dense_batching(app: str) -> dict[str, int]:
    """The dense part's batching counters in a set app (calls and batches so far)."""
    from ray import serve

    host = serve.get_deployment_handle("dense-cpu-std", app_name=app)
    described = await asyncio.to_thread(lambda: host.describe.remote().result())
    return {k: int(described["batching"][k]) for k in ("calls", "batches")}


async def measure_serving(rate: float, seconds: float, candidates: int, concurrency: int) -> dict[str, Any]:
    from ipnext.client.devstack.stack import DevStack, scratch_config
    from ipnext.client.sdk import Client
    from ipnext.examples.request_ranker.train import World, shard_parts, train
    from ipnext.spec.model import ModelSpec, load_model_spec
    from ipnext.spec.settings import load_settings
    from ipnext.store.snapshots import write_snapshot

    config_path = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bench-", dir="/tmp")), REPO / "config")
    dev = DevStack(config_path=config_path)
    dev.up()
    try:
        settings = load_settings(config_path)
        root = settings.snapshot_roots[0]
        sizes: dict[str, Any] = {}  # RankingConfig's defaults: the sizes
        base = load_model_spec(REPO / "examples" / "request_ranker" / "model.yaml").model_dump(mode="json")
        models = {"request": "bench-ranking", "naive": "bench-ranking-naive"}
        bounds = {5: "bench-ranking-router5", 100: "bench-ranking-router100"}
        print(f"serving: training the snapshot ({sizes or 'default sizes'}) ...")
        report = train(root, models["request"], "v1", config=sizes, steps=40)
        weights = {**shard_parts(report.model, 1), "dense": report.model.dense_weights()}
        for name in [models["naive"], *bounds.values()]:
            write_snapshot(root / name / "v1", name, "v1", weights)
        world = World(RankingConfig.from_config(sizes))
        rng = random.Random(3)
        requests = [world.request(rng, candidates) for _ in range(int(rate * seconds))]
        results: dict[str, Any] = {"rate_per_s": rate, "seconds": seconds, "candidates": candidates}
        async with await Client.connect(settings) as ipn:
            for path, name in models.items():
                data = json.loads(json.dumps(base))
                data.update(name=name, traffic={"peak_qps": {"us-east": 10}})
                for part in ("embed", "dense"):
                    data["parts"][part]["config"] = sizes
                if path == "naive":
                    data["parts"]["dense"]["factory"] = "ipnext.examples.request_ranker.parts:PairRankerPart"
                await ipn.publish_model(ModelSpec.model_validate(data))
                published = await ipn.publish_snapshot(name, root / name / "v1", who="bench")
                print(f"serving: {name} published as {published.set_id}, waiting until it serves ...")
                await ipn.wait_until_serving(name, published.set_id, timeout_s=300)
                url = f"{settings.serve_url}/us-east/models/{name}/predict"
                await open_loop(url, requests[: max(3, int(rate))], rate, key_header(settings))  # warm-up
                results[path] = await open_loop(url, requests, rate, key_header(settings))
                r = results[path]
                print(
                    f"serving {path}: {r['answered']}/{r['requests']} answered at {rate}/s with {candidates} "
                    f"candidates, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, failed {r['failed']}"
                )
                await ipn.delete_model(name)
            from ipnext.serving.control import connect_for

            connect_for(settings)
            results["router_bound"] = {"callers": concurrency, "seconds": seconds, "candidates": candidates}
            for bound, name in bounds.items():
                data = json.loads(json.dumps(base))
                data.update(
                    name=name, traffic={"peak_qps": {"us-east": 10}}, router={"max_ongoing_requests": bound}
                )
                for part in ("embed", "dense"):
                    data["parts"][part]["config"] = sizes
                await ipn.publish_model(ModelSpec.model_validate(data))
                published = await ipn.publish_snapshot(name, root / name / "v1", who="bench")
                print(
                    f"router bound {bound}: {name} published as {published.set_id}, "
                    "waiting until it serves ..."
                )
                await ipn.wait_until_serving(name, published.set_id, timeout_s=300)
                url = f"{settings.serve_url}/us-east/models/{name}/predict"
                await closed_loop(url, requests, concurrency, 3.0, key_header(settings))  # warm-up
                app = f"{name}.us-east.s1.r1"
                before = await dense_batching(app)
                r = await closed_loop(url, requests, concurrency, seconds, key_header(settings))
                after = await dense_batching(app)
                calls, batches = (after[k] - before[k] for k in ("calls", "batches"))
                r["dense_mean_batch"] = round(calls / batches, 2) if batches else None
                results["router_bound"][str(bound)] = r
                print(
                    f"router bound {bound}: {r['answered']} answered in {r['seconds']} s "
                    f"by {concurrency} callers "
                    f"({r['per_s']}/s), p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, failed {r['failed']}, "
                    f"dense mean batch {r['dense_mean_batch']}"
                )
                await ipn.delete_model(name)
            low, high = (results["router_bound"][str(b)]["per_s"] for b in bounds)
            results["router_bound"]["throughput_ratio"] = round(high / low, 2) if low else None
            print(f"router bound: throughput at 100 / at 5 = {results['router_bound']['throughput_ratio']}x")
        return results
    finally:
        dev.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-serving", action="store_true", help="skip the Ray Serve measurement")
    parser.add_argument("--rate", type=float, default=2.0, help="serving: requests per second, both paths")
    parser.add_argument("--seconds", type=float, default=30.0, help="serving: how long the load runs")
    parser.add_argument("--serve-candidates", type=int, default=100, help="serving: candidates per request")
    parser.add_argument("--concurrency", type=int, default=32, help="router bound: closed-loop callers")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ranking.json")
    args = parser.parse_args()
    result: dict[str, Any] = {"model": measure_model(args.candidates, args.repeats)}
    if not args.no_serving:
        result["serving"] = asyncio.run(
            measure_serving(args.rate, args.seconds, args.serve_candidates, args.concurrency)
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
