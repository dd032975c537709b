"""Bad input on the real stack: each is refused with an error naming what is wrong and the fix,
and nothing is created or changed (no workflow, no set, no Serve app)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pydantic
import pytest
import pytest_asyncio
import torch
from temporalio.service import RPCError

from ipnext.client.sdk import Client
from ipnext.errors import SnapshotError, SpecError
from ipnext.examples.click_ranker.train import train
from ipnext.names import model_workflow_id, poll_until
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSetRequest
from ipnext.spec.settings import Settings
from ipnext.store.snapshots import request_from_folder

from .conftest import MODEL_CODE, ensure_stack_up, one_region_spec, train_version
from .test_lifecycle import serve_apps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def serving_model(shared_stack: Settings, stack_config: Path) -> AsyncIterator[str]:
    """A model serving its v1, the target of every bad publish below."""
    ensure_stack_up(stack_config)
    stack = shared_stack
    name = f"r{uuid.uuid4().hex[:6]}"
    async with await Client.connect(stack) as ipn:
        await ipn.publish_model(one_region_spec(name))
        folder, _ = train_version(stack, name, "v1")
        published = await ipn.publish_snapshot(name, folder)
        await ipn.wait_until_serving(name, published.set_id)
        yield name
        await ipn.delete_model(name, who="test")


def _with_part(request: SnapshotSetRequest, part: str, **changes: str) -> SnapshotSetRequest:
    parts = dict(request.parts)
    parts[part] = parts[part].model_copy(update=changes)
    return request.model_copy(update={"parts": parts, "version": f"bad-{uuid.uuid4().hex[:6]}"})


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_cyclic_dag_creates_nothing(stack: Settings, client: Client) -> None:
    name = f"c{uuid.uuid4().hex[:6]}"
    data = one_region_spec(name).model_dump(mode="json")
    data["dag"] = [["input", "embed"], ["embed", "dense"], ["dense", "embed"], ["dense", "output"]]
    with pytest.raises(
        pydantic.ValidationError, match=r"cycle (embed -> dense -> embed|dense -> embed -> dense)"
    ):
        ModelSpec.model_validate(data)
    # The CLI and SDK parse specs through parse_spec, which turns that into a SpecError:
    from ipnext.spec.reading import parse_spec

    with pytest.raises(SpecError, match="dag: cycle"):
        parse_spec(ModelSpec, data, source="model.yaml")
    with pytest.raises(RPCError):
        await client.temporal.get_workflow_handle(model_workflow_id(name)).describe()


async def test_unknown_hardware_creates_nothing(stack: Settings, client: Client) -> None:
    name = f"h{uuid.uuid4().hex[:6]}"
    data = one_region_spec(name).model_dump(mode="json")
    data["parts"]["dense"]["hardware"] = {"gpu-h100": {"units": 1, "qps": 900}}
    with pytest.raises(
        SpecError, match=r"parts\.dense\.hardware: hardware class 'gpu-h100' is not in the fleet"
    ):
        await client.publish_model(ModelSpec.model_validate(data))
    with pytest.raises(RPCError):
        await client.temporal.get_workflow_handle(model_workflow_id(name)).describe()


async def test_a_factory_the_worker_cannot_import_creates_nothing(stack: Settings, client: Client) -> None:
    """The worker imports the factories (in a child process), not this test's process."""
    name = f"f{uuid.uuid4().hex[:6]}"
    data = one_region_spec(name).model_dump(mode="json")
    data["parts"]["dense"]["factory"] = "ipnext.examples.missing_module_q7:DensePart"  # allowed, absent
    with pytest.raises(
        SpecError, match=r"parts\.dense\.factory: .*'ipnext\.examples\.missing_module_q7' does not import"
    ):
        await client.publish_model(ModelSpec.model_validate(data))
    with pytest.raises(RPCError):
        await client.temporal.get_workflow_handle(model_workflow_id(name)).describe()


def _bad_requests(stack: Settings, model: str, tmp: Path) -> dict[str, tuple[SnapshotSetRequest, str]]:
    root = stack.snapshot_roots[0]
    good_folder, _ = train_version(stack, model, f"good-{uuid.uuid4().hex[:6]}")
    good = request_from_folder(good_folder)
    outside = tmp / "dense.safetensors"
    outside.write_bytes((good_folder / "dense.safetensors").read_bytes())
    missing = root / model / "never-written" / "dense.safetensors"
    posing = root / model / "posing"
    posing.mkdir(parents=True)
    pickle_file = posing / "dense.safetensors"
    torch.save({"mlp.0.weight": torch.zeros(2, 2)}, pickle_file)
    raw_pickle = posing / "raw.safetensors"
    raw_pickle.write_bytes(pickle.dumps({"mlp.0.weight": [0.0]}))
    misfit = train(
        root,
        model,
        f"misfit-{uuid.uuid4().hex[:6]}",
        steps=5,
        config={"num_users": 200, "num_items": 500, "dim": 8, "hidden": 32},
    )
    return {
        "outside the root": (
            _with_part(good, "dense", uri=outside.as_uri(), sha256=_sha(outside)),
            "outside every snapshot root",
        ),
        "path escape": (
            _with_part(good, "dense", uri=str(root / model / os.path.relpath(outside, root / model))),
            "outside every snapshot root",
        ),
        "missing file": (_with_part(good, "dense", uri=missing.as_uri()), "does not exist"),
        "wrong checksum": (_with_part(good, "dense", sha256="0" * 64), "checksum mismatch"),
        "torch.save pickle": (
            _with_part(good, "dense", uri=pickle_file.as_uri(), sha256=_sha(pickle_file)),
            "not a safetensors file",
        ),
        "raw pickle": (
            _with_part(good, "dense", uri=raw_pickle.as_uri(), sha256=_sha(raw_pickle)),
            "not a safetensors file",
        ),
        "tensors that do not fit": (
            request_from_folder(misfit.folder).model_copy(
                update={"version": f"misfit-{uuid.uuid4().hex[:6]}"}
            ),
            "tensors do not fit the part",
        ),
    }


async def test_bad_snapshots_change_nothing(
    stack: Settings, client: Client, serving_model: str, tmp_path: Path
) -> None:
    before = await client.get_model(serving_model)
    apps_before = serve_apps(stack)
    for case, (request, expected) in _bad_requests(stack, serving_model, tmp_path).items():
        with pytest.raises(SnapshotError) as caught:
            await client.publish_snapshot(serving_model, request)
        assert expected in str(caught.value), f"{case}: {caught.value}"
        assert "parts.dense" in str(caught.value) or "parts.embed" in str(caught.value), case
    after = await client.get_model(serving_model)
    assert after.sets == before.sets
    assert after.serving_set == before.serving_set and after.queued == []
    assert serve_apps(stack) == apps_before
    reply = await client.predict(serving_model, {"user": 1, "items": [2]})
    assert reply.set == before.serving_set


async def test_wrong_model_and_unknown_part_rejected_by_the_validator(
    client: Client, serving_model: str
) -> None:
    ref = SnapshotRef(uri="file:///nowhere", sha256="0" * 64, snapshot_id="x")
    for request, expected in (
        (SnapshotSetRequest(model="other-model", version="v9", parts={"embed": ref}), "is for 'other-model'"),
        (SnapshotSetRequest(model=serving_model, version="v9", parts={"bogus": ref}), "bogus"),
        (SnapshotSetRequest(model=serving_model, version="v1", parts={"embed": ref}), "already published"),
    ):
        with pytest.raises(SnapshotError, match=expected):
            await client.publish_snapshot(serving_model, request)


def _with_dense_factory(name: str, factory: str) -> ModelSpec:
    data = one_region_spec(name).model_dump(mode="json")
    data["parts"]["dense"]["factory"] = factory
    return ModelSpec.model_validate(data)


async def _validating(client: Client, name: str) -> bool:
    """Whether the model's snapshot validation (the activity) is running now."""
    description = await client.temporal.get_workflow_handle(model_workflow_id(name)).describe()
    pending = description.raw_description.pending_activities
    return any(activity.activity_type.name == "validate_snapshot_set" for activity in pending)


async def test_model_code_that_misbehaves_is_refused_while_the_worker_serves_others(
    stack: Settings, client: Client
) -> None:
    """Factories outside model_code.factory_prefixes are refused before anything imports them;
    a part that hangs or allocates without bound when built with its weights is refused at its
    snapshot publish, in the child, while the same worker validates and rolls out another model."""
    began = time.perf_counter()
    prefixes = re.escape(str(MODEL_CODE["factory_prefixes"]))
    for factory in ("os:system", "json:loads"):
        name = f"x{uuid.uuid4().hex[:6]}"
        with pytest.raises(
            SpecError,
            match=rf"parts\.dense\.factory: '{re.escape(factory)}' is outside the modules this worker "
            rf"may import \(model_code\.factory_prefixes: {prefixes}\); nothing was imported",
        ):
            await client.publish_model(_with_dense_factory(name, factory))
        with pytest.raises(RPCError):
            await client.temporal.get_workflow_handle(model_workflow_id(name)).describe()

    hangs, hoards, other = (f"{kind}{uuid.uuid4().hex[:6]}" for kind in ("s", "m", "o"))
    # These import cleanly, so they register; their parts misbehave only when built.
    await asyncio.gather(
        client.publish_model(_with_dense_factory(hangs, "tests.bad_parts:sleeps_forever")),
        client.publish_model(_with_dense_factory(hoards, "tests.bad_parts:allocates")),
        client.publish_model(one_region_spec(other)),
    )
    root = stack.snapshot_roots[0]
    # A few steps: the weights need only fit their parts (a first set passes no gates).
    folders = {name: train(root, name, "v1", steps=5).folder for name in (hangs, hoards, other)}
    print(f"\nrefused two, registered three and trained in {time.perf_counter() - began:.1f} s")

    started = time.perf_counter()
    hanging = asyncio.create_task(client.publish_snapshot(hangs, folders[hangs]))
    await poll_until(
        lambda: _validating(client, hangs), bool, timeout_s=60, interval_s=0.2, what=f"{hangs} validating"
    )
    seen = time.perf_counter() - started
    published = await client.publish_snapshot(other, folders[other])  # the same worker, meanwhile
    accepted = time.perf_counter() - started
    assert not hanging.done(), "the other model's publish waited for the hanging build"
    progress: list[str] = []
    serving = asyncio.create_task(
        client.wait_until_serving(
            other,
            published.set_id,
            on_progress=lambda s: progress.append(f"{time.perf_counter() - started:.1f} s {s.step}"),
        )
    )
    with pytest.raises(
        SpecError,
        match=rf"model {hangs}: building part dense with snapshot .* did not finish within [\d.]+ s "
        r"\(the check was killed; what was left of the set's 15 s, model_code\.validation_timeout_s\)",
    ):
        await hanging
    refused = time.perf_counter() - started
    with pytest.raises(
        SpecError,
        match=rf"model {hoards}: building part dense .* ran out of memory: the check may use 1 GiB of "
        r"private memory \(model_code\.validation_memory_bytes\)",
    ):
        await client.publish_snapshot(hoards, folders[hoards])
    out_of_memory = time.perf_counter() - started
    state = await serving
    print(
        f"hanging build running at {seen:.1f} s; {other}'s publish accepted at {accepted:.1f} s; "
        f"the hanging build refused at {refused:.1f} s; the hoarding one at {out_of_memory:.1f} s; "
        f"{other} serving at {time.perf_counter() - started:.1f} s; its rollout meanwhile: {progress}"
    )
    assert state.serving_set == published.set_id
    for name in (hangs, hoards):
        assert (await client.get_model(name)).sets == []  # refused: nothing published
    await asyncio.gather(*(client.delete_model(name, who="test") for name in (hangs, hoards, other)))
    print(f"all done in {time.perf_counter() - began:.1f} s")
