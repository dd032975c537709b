"""The shadow drill on the real stack: callers' latency with and without 50% of their requests
copied to a candidate (measured in the same run on a part that sleeps rather than computes, so
the copies compete for the router, not for the cores: printed, never asserted); a candidate equal
to the serving set compares as equal; a different one reports the true difference, computed here
from the two snapshots' weight files; and no caller ever gets a candidate's answer."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from ipnext.config import Settings
from ipnext.contracts import poll_until
from ipnext.examples.click_ranker.parts import DensePart, EmbeddingPart
from ipnext.examples.click_ranker.train import train
from ipnext.model import ModelSpec
from ipnext.registry import ExperimentStatus
from ipnext.sdk import Client
from ipnext.shadow import compare_answers
from ipnext.snapshots import write_snapshot

from .conftest import keyed, one_region_spec, train_version
from .load import Load

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

# Each latency phase's length (a setting: bench-length phases would run minutes).
PHASE_S = 8.0
DELAY_MS = 20  # the dense part sleeps this long per call: latency without CPU
USER, ITEMS = 3, [5, 17, 42, 99, 123, 256, 300, 411]  # every request the same: one true difference


def the_request(user: int) -> dict[str, Any]:
    return {"user": USER, "items": ITEMS}


async def expected_outputs(folder: Path, config: dict[str, Any]) -> list[float]:
    """What a set's parts answer THE request, computed here from its weight files."""
    embed = EmbeddingPart(load_file(str(folder / "embed.safetensors")), config)
    dense = DensePart(load_file(str(folder / "dense.safetensors")), config)
    vectors = await embed({"input": {"user": USER, "items": ITEMS}})
    return await dense({"embed": vectors})


async def shadow_until(client: Client, model: str, compared: int) -> ExperimentStatus:
    return await poll_until(
        lambda: client.experiment_status(model),
        lambda s: s.phase == "running" and s.shadow is not None and s.shadow.compared >= compared,
        timeout_s=120,
        interval_s=0.5,
        what=f"{model}'s shadow with {compared} comparisons",
    )


async def test_a_shadow_compares_without_touching_callers(
    stack: Settings, client: Client, model_name: str
) -> None:
    spec = one_region_spec(model_name)
    data = spec.model_dump(mode="json")
    data["parts"]["dense"]["config"]["delay_ms"] = DELAY_MS
    spec = ModelSpec.model_validate(data)
    config = data["parts"]["dense"]["config"]
    await client.publish_model(spec)
    v1, _ = train_version(stack, model_name, "v1")
    serving = (await client.publish_snapshot(model_name, v1)).set_id
    await client.wait_until_serving(model_name, serving)
    # Two held candidates: v1's weights under another version (equal), and v2 (trained apart).
    weights = {part: load_file(str(v1 / f"{part}.safetensors")) for part in ("embed", "dense")}
    copy = stack.snapshot_roots[0] / model_name / "v1-copy"
    write_snapshot(copy, model_name, "v1-copy", weights)
    equal = await client.publish_snapshot(model_name, copy, hold=True)
    v2 = train(stack.snapshot_roots[0], model_name, "v2", seed=2, steps=300).folder
    different = await client.publish_snapshot(model_name, v2, hold=True)
    path = f"/us-east/models/{model_name}/predict"

    # 1. Callers' latency without a shadow, then with 50% copied to the equal candidate.
    async with Load(stack.serve_url, path, headers=keyed(stack), inputs=the_request) as alone:
        await asyncio.sleep(PHASE_S)
    await client.start_shadow(
        model_name, equal.set_id, 50, duration_seconds=600, check_seconds=1, shadow="equal"
    )
    async with Load(stack.serve_url, path, headers=keyed(stack), inputs=the_request) as shadowed:
        await shadow_until(client, model_name, 1)  # the routers copy: the measured phase starts
        copying_from = shadowed.elapsed()
        await asyncio.sleep(PHASE_S)
        status = await shadow_until(client, model_name, 20)
    await client.stop_experiment(model_name, "measured", who="test")
    same = status.shadow
    assert same is not None
    print(f"equal candidate: {same}")
    assert same.max_abs_diff_mean == 0.0 and same.differing == 0.0 and same.mismatched == 0
    assert same.rank_correlation_mean == 1.0 and same.top_k_overlap_mean == 1.0
    assert same.candidate_errors == 0 and status.shadow_windows

    # 2. The different candidate: every comparison finds the difference the weight files give.
    truth = compare_answers(await expected_outputs(v1, config), await expected_outputs(v2, config), top_k=3)
    assert truth["shadow.max_abs_diff"] > 1e-3  # v2 does answer otherwise
    await poll_until(
        lambda: client.get_model(model_name),
        lambda s: s.experiment is None,
        timeout_s=120,
        interval_s=0.5,
        what="the equal shadow ended",
    )
    await client.start_shadow(
        model_name, different.set_id, 50, duration_seconds=600, check_seconds=1, shadow="different"
    )
    async with Load(stack.serve_url, path, headers=keyed(stack), inputs=the_request) as third:
        status = await shadow_until(client, model_name, 20)
    await client.stop_experiment(model_name, "measured", who="test")
    found = status.shadow
    assert found is not None
    print(f"different candidate: {found}; the weight files give {truth}")
    # The parts round scores to 6 decimals: equal up to that.
    assert found.max_abs_diff_mean == pytest.approx(truth["shadow.max_abs_diff"], abs=2e-6)
    assert found.differing == 1.0 and found.mismatched == 0
    assert found.rank_correlation_mean == pytest.approx(truth["shadow.rank_correlation"])
    assert found.top_k_overlap_mean == pytest.approx(truth["shadow.top_k_overlap"])

    # No caller ever got a candidate's answer; none failed.
    answers = [*alone.answers, *shadowed.answers, *third.answers]
    assert answers and all(a.status == 200 and a.set == serving for a in answers), [
        a for a in answers if a.status != 200 or a.set != serving
    ][:3]
    assert all(a.parts == {p: f"{model_name}/{p}@v1" for p in ("embed", "dense")} for a in answers)
    p50_alone = statistics.median(a.latency_s for a in alone.answers) * 1000
    measured = [a for a in shadowed.answers if a.at >= copying_from]
    p50_shadowed = statistics.median(a.latency_s for a in measured) * 1000
    print(
        f"callers' p50 without a shadow {p50_alone:.1f} ms ({len(alone.answers)} requests), with 50% "
        f"copied {p50_shadowed:.1f} ms ({len(measured)}): ratio {p50_shadowed / p50_alone:.3f} "
        f"(goal: within 5%); {same.compared} comparisons, {same.dropped} dropped"
    )
    ended = await poll_until(
        lambda: client.get_model(model_name),
        lambda s: s.experiment is None,
        timeout_s=120,
        interval_s=0.5,
        what="the second shadow ended",
    )
    kept = {s.id: s for s in ended.sets}
    assert kept[different.set_id].status == "held" and "shadow different:" in kept[different.set_id].detail
    await client.delete_model(model_name, who="test")
