"""validate_snapshot against a trained ranker snapshot, and complete_set for both sync modes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ipnext.errors import SnapshotError
from ipnext.examples.click_ranker.train import DEFAULT_CONFIG, train
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSetRequest
from ipnext.spec.reading import parse_spec
from ipnext.store.snapshots import request_from_folder, sha256_file
from ipnext.store.validation import complete_set, validate_snapshot
from tests.unit.helpers import MODEL, Trained, spec_dict


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A snapshot trained with dim 8: it does not fit the example spec's dim-16 parts."""
    root = tmp_path_factory.mktemp("narrow")
    report = train(root, MODEL, "v-dim8", steps=5, config={**DEFAULT_CONFIG, "dim": 8})
    return Trained(root=root, folder=report.folder, request=request_from_folder(report.folder))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """The pinned store validation copies into (ipnext/store/pinned.py)."""
    return tmp_path / "pinned"


def ref(trained: Trained, part: str) -> SnapshotRef:
    return trained.request.parts[part]


def validation_error(
    spec: ModelSpec, part: str, snapshot: SnapshotRef, roots: list[Path], store: Path
) -> SnapshotError:
    with pytest.raises(SnapshotError) as info:
        validate_snapshot(spec, part, snapshot, roots, store)
    assert f"parts.{part} ({snapshot.snapshot_id})" in str(info.value)
    return info.value


# --- validate_snapshot ------------------------------------------------------------------------


@pytest.mark.parametrize("part", ["embed", "dense"])
def test_trained_snapshot_validates(
    example_spec: ModelSpec, trained: Trained, part: str, store: Path
) -> None:
    validate_snapshot(
        example_spec, part, ref(trained, part), [trained.root], store
    )  # raises if it does not fit


def test_a_second_root_is_enough(
    example_spec: ModelSpec, trained: Trained, tmp_path: Path, store: Path
) -> None:
    validate_snapshot(example_spec, "embed", ref(trained, "embed"), [tmp_path, trained.root], store)


def test_missing_file(example_spec: ModelSpec, trained: Trained, store: Path) -> None:
    missing = trained.folder / "gone.safetensors"
    snapshot = ref(trained, "embed").model_copy(update={"uri": missing.as_uri()})
    err = validation_error(example_spec, "embed", snapshot, [trained.root], store)
    assert "does not exist" in str(err)
    assert str(missing) in str(err)
    assert err.field == "parts.embed.uri"


def test_wrong_checksum(example_spec: ModelSpec, trained: Trained, store: Path) -> None:
    snapshot = ref(trained, "dense").model_copy(update={"sha256": "0" * 64})
    err = validation_error(example_spec, "dense", snapshot, [trained.root], store)
    assert "checksum" in str(err)
    assert "0" * 64 in str(err)
    assert sha256_file(trained.folder / "dense.safetensors") in str(err)
    assert err.field == "parts.dense.sha256"


def test_changed_file_fails_its_checksum(
    example_spec: ModelSpec, trained: Trained, tmp_path: Path, store: Path
) -> None:
    copy = tmp_path / "embed.safetensors"
    shutil.copy(trained.folder / "embed.safetensors", copy)
    with copy.open("ab") as f:
        f.write(b"\0")
    snapshot = ref(trained, "embed").model_copy(update={"uri": copy.as_uri()})
    assert "checksum mismatch" in str(validation_error(example_spec, "embed", snapshot, [tmp_path], store))


def test_path_outside_the_roots(
    example_spec: ModelSpec, trained: Trained, tmp_path: Path, store: Path
) -> None:
    with pytest.raises(SnapshotError) as info:
        validate_snapshot(example_spec, "embed", ref(trained, "embed"), [tmp_path], store)
    assert "outside" in str(info.value)
    assert ref(trained, "embed").uri in str(info.value)


def test_tensors_that_do_not_fit_the_embed_part(
    example_spec: ModelSpec, narrow: Trained, store: Path
) -> None:
    err = validation_error(example_spec, "embed", ref(narrow, "embed"), [narrow.root], store)
    message = str(err)
    assert "do not fit" in message
    assert "user.weight" in message
    assert "[200, 8]" in message and "[200, 16]" in message
    assert err.field == "parts.embed"


def test_tensors_that_do_not_fit_the_dense_part(
    example_spec: ModelSpec, narrow: Trained, store: Path
) -> None:
    message = str(validation_error(example_spec, "dense", ref(narrow, "dense"), [narrow.root], store))
    assert "do not fit" in message
    assert "mlp.0.weight" in message


def test_the_narrow_snapshot_fits_a_narrow_spec(narrow: Trained, store: Path) -> None:
    data = spec_dict()
    for part in data["parts"].values():
        part["config"]["dim"] = 8
    spec = parse_spec(ModelSpec, data)
    for part in ("embed", "dense"):
        validate_snapshot(spec, part, ref(narrow, part), [narrow.root], store)


def test_weights_of_the_other_part_do_not_fit(example_spec: ModelSpec, trained: Trained, store: Path) -> None:
    swapped = ref(trained, "dense").model_copy(update={"snapshot_id": "feed-ranker/embed@swapped"})
    message = str(validation_error(example_spec, "embed", swapped, [trained.root], store))
    assert "do not fit" in message
    assert "user.weight" in message


# --- complete_set -----------------------------------------------------------------------------


def independent_spec() -> ModelSpec:
    data = spec_dict()
    data["sync"] = "independent"
    return parse_spec(ModelSpec, data)


def request(trained: Trained, *parts: str) -> SnapshotSetRequest:
    return SnapshotSetRequest(model=MODEL, version="v2", parts={p: trained.request.parts[p] for p in parts})


def serving_set() -> dict[str, SnapshotRef]:
    return {
        part: SnapshotRef(uri=f"file:///old/{part}", sha256="a" * 64, snapshot_id=f"{MODEL}/{part}@v0")
        for part in ("embed", "dense")
    }


def test_synchronized_set_with_every_part(example_spec: ModelSpec, trained: Trained) -> None:
    assert complete_set(example_spec, trained.request, None) == dict(trained.request.parts)
    assert complete_set(example_spec, trained.request, serving_set()) == dict(trained.request.parts)


def test_synchronized_set_needs_every_part(example_spec: ModelSpec, trained: Trained) -> None:
    with pytest.raises(SnapshotError) as info:
        complete_set(example_spec, request(trained, "embed"), serving_set())
    assert "['dense']" in str(info.value)
    assert "synchronized" in str(info.value)
    assert info.value.field == "parts"
    assert info.value.value == ["dense"]


def test_independent_set_takes_missing_parts_from_serving(trained: Trained) -> None:
    serving = serving_set()
    got = complete_set(independent_spec(), request(trained, "embed"), serving)
    assert got == {"embed": trained.request.parts["embed"], "dense": serving["dense"]}


def test_independent_set_without_a_serving_set(trained: Trained) -> None:
    with pytest.raises(SnapshotError) as info:
        complete_set(independent_spec(), request(trained, "dense"), None)
    assert "['embed']" in str(info.value)
    assert "no set serves yet" in str(info.value)


@pytest.mark.parametrize("sync", ["synchronized", "independent"])
def test_unknown_part_is_rejected(trained: Trained, sync: str) -> None:
    data = spec_dict()
    data["sync"] = sync
    spec = parse_spec(ModelSpec, data)
    parts = {**trained.request.parts, "ghost": trained.request.parts["embed"]}
    bad = SnapshotSetRequest(model=MODEL, version="v2", parts=parts)
    with pytest.raises(SnapshotError) as info:
        complete_set(spec, bad, serving_set())
    assert "'ghost'" in str(info.value)
    assert info.value.field == "parts.ghost"
