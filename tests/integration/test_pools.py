"""A shared pool app on the real stack's Ray Serve, deployed through the one config writer: six
models' parts with real pinned safetensors served from one replica within a byte budget that
holds four, each answering with its own weights; a part whose factory raises is quarantined while
the rest serve; the catalogue changes in place (same process) and a retired part is unloaded."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray import serve
from safetensors.torch import save_file

from ipnext.examples.click_ranker.parts import build_modules
from ipnext.serving.control import connect_for, wait_apps_gone, wait_apps_running, writer_for
from ipnext.serving.layout import PartHostArgs
from ipnext.serving.pool_layout import (
    POOL_DEPLOYMENT,
    PoolAppArgs,
    PoolCatalogue,
    PoolEntry,
    pool_app_name,
    render_pool_app,
)
from ipnext.spec.settings import DEFAULT_FACTORY_PREFIXES, PoolSettings, Settings
from ipnext.store.pinned import pin

pytestmark = pytest.mark.timeout(300)

CONFIG = {"num_users": 2000, "num_items": 2000, "dim": 64}  # about 1 MiB of tables per model
EMBED = "ipnext.examples.click_ranker.parts:EmbeddingPart"
MODELS = [f"pooled-{i}" for i in range(6)]


def snapshot(folder: Path, store: Path, seed: int) -> tuple[str, int, dict[str, torch.Tensor]]:
    """An embedding part's weights, written and pinned as validation pins them."""
    torch.manual_seed(seed)
    modules = build_modules(CONFIG)
    tensors = {
        "user.weight": modules.user.weight.detach().clone(),
        "item.weight": modules.item.weight.detach().clone(),
    }
    path = folder / f"embed-{seed}.safetensors"
    save_file(tensors, str(path))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    pin(path, sha, store)
    return sha, path.stat().st_size, tensors


def entry(model: str, sha: str, size: int, store: Path, factory: str = EMBED) -> PoolEntry:
    app = f"{model}.us-east.s1.r1"
    host = PartHostArgs(
        model=model,
        part="embed",
        factory=factory,
        config=CONFIG,
        uri=f"file:///snapshots/{model}",
        sha256=sha,
        snapshot_id=f"{model}-v1",
        pinned_store=str(store),
        region="us-east",
        app=app,
        factory_prefixes=[*DEFAULT_FACTORY_PREFIXES, "tests.bad_parts"],
    )
    return PoolEntry(host=host, estimate_bytes=size)


def ask(app: str, entry_id: str, user: int) -> Any:
    handle = serve.get_deployment_handle(POOL_DEPLOYMENT, app_name=app)
    inputs = {"input": {"user": user, "items": [1, 2]}}
    return handle.options(multiplexed_model_id=entry_id).remote(inputs).result(timeout_s=60)


def describe(app: str) -> dict[str, Any]:
    described: dict[str, Any] = (
        serve.get_deployment_handle(POOL_DEPLOYMENT, app_name=app).describe.remote().result(timeout_s=60)
    )
    return described


def test_a_pool_serves_many_models_within_its_bytes(stack: Settings, tmp_path: Path) -> None:
    connect_for(stack)
    store = tmp_path / "pinned"
    made = {model: snapshot(tmp_path, store, seed) for seed, model in enumerate(MODELS)}
    size = next(iter(made.values()))[1]
    entries = {f"{m}.us-east.s1.r1/embed": entry(m, sha, n, store) for m, (sha, n, _) in made.items()}
    bad = entry("pooled-bad", made[MODELS[0]][0], size, store, factory="tests.bad_parts:raises")
    entries["pooled-bad.us-east.s1.r1/embed"] = bad
    # Room for four parts: each counts at least its pinned file's size.
    args = PoolAppArgs(
        region="us-east", hardware="cpu-std", pools=PoolSettings(budget_bytes=4 * size + size // 2)
    )
    name = pool_app_name("us-east", "cpu-std")
    writer = writer_for(stack)
    ray.get(writer.apply.remote([render_pool_app(args, PoolCatalogue(entries=entries), 1, 1, 0)], []))
    try:
        wait_apps_running([name], timeout_s=120)
        for round_ in range(2):  # six models through a budget of four: the second round evicts again
            for model, (_, _, tensors) in made.items():
                answer = ask(name, f"{model}.us-east.s1.r1/embed", user=3)
                assert answer["snapshot_id"] == f"{model}-v1"
                assert torch.equal(answer["output"]["user"], tensors["user.weight"][3:4]), (
                    f"{model} round {round_}"
                )
        for _ in range(3):  # the bad part fails, then is refused; its pool-mates serve between
            with pytest.raises(Exception, match=r"missing from the snapshot|quarantined"):
                ask(name, "pooled-bad.us-east.s1.r1/embed", user=1)
            assert ask(name, f"{MODELS[5]}.us-east.s1.r1/embed", user=1)["snapshot_id"] == f"{MODELS[5]}-v1"
        before = describe(name)
        stats = before["stats"]
        print(f"pool after 2 rounds of 6 models, budget 4: {stats}")
        assert stats["evictions"] >= 6 and stats["committed_bytes"] <= stats["budget_bytes"]
        assert [q["part"] for q in stats["quarantined"]] == ["pooled-bad/embed@pooled-bad-v1"]
        assert len(before["held"]) <= 4

        kept = {k: v for k, v in entries.items() if k.startswith(MODELS[5])}
        ray.get(writer.apply.remote([render_pool_app(args, PoolCatalogue(entries=kept), 1, 1, 0)], []))
        wait_apps_running([name], timeout_s=120)
        after = describe(name)
        assert after["replica"] == before["replica"], "a catalogue change restarted the pool replica"
        assert (after["entries"], after["held"]) == (1, [f"{MODELS[5]}/embed@{MODELS[5]}-v1"])
        with pytest.raises(Exception, match="no entry"):
            ask(name, f"{MODELS[0]}.us-east.s1.r1/embed", user=1)
    finally:
        ray.get(writer.apply.remote([], [name]))
        wait_apps_gone([name], timeout_s=120)
