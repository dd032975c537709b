"""The factory allow-list: which module paths a spec may name (`model_code.factory_prefixes`),
decided before anything is imported, and where the resolved callable must be defined."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipnext.errors import SpecError
from ipnext.spec.model import (
    ModelSpec,
    check_factories,
    check_factories_allowed,
    import_factory,
    load_model_spec,
    module_allowed,
)
from ipnext.spec.settings import DEFAULT_FACTORY_PREFIXES, ModelCodeSettings, Settings
from tests.unit.helpers import REPO

EXAMPLES = REPO / "examples"


def with_factory(spec: ModelSpec, part: str, factory: str) -> ModelSpec:
    data = spec.model_dump(mode="json")
    data["parts"][part]["factory"] = factory
    return ModelSpec.model_validate(data)


@pytest.mark.parametrize(
    ("module", "prefixes", "allowed"),
    [
        ("ipnext.examples.click_ranker.parts", ["ipnext."], True),
        ("ipnext.serving.llm.part", ["ipnext."], True),
        ("ipnext", ["ipnext."], False),  # a trailing dot covers the package's modules only
        ("ipnext_evil", ["ipnext."], False),
        ("ipnext_evil", ["ipnext"], False),  # never a bare string prefix
        ("ipnext", ["ipnext"], True),
        ("ipnext.parts", ["ipnext"], True),
        ("os", ["ipnext."], False),
        ("acme.parts", ["ipnext.", "acme.parts"], True),
        ("acme.parts.dense", ["ipnext.", "acme.parts"], True),
        ("acme.partsx", ["ipnext.", "acme.parts"], False),
        ("acme.other", ["ipnext.", "acme.parts"], False),
        ("ipnext.x", [], False),
    ],
)
def test_module_allowed(module: str, prefixes: list[str], allowed: bool) -> None:
    assert module_allowed(module, prefixes) is allowed


@pytest.mark.parametrize(
    "path", sorted(EXAMPLES.glob("*/model*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_the_default_allows_every_example(path: Path) -> None:
    """The examples import as `ipnext.examples.*` (ipnext/examples links to examples/)."""
    prefixes = ModelCodeSettings().factory_prefixes
    assert prefixes == list(DEFAULT_FACTORY_PREFIXES)
    spec = load_model_spec(path)
    check_factories_allowed(spec, prefixes)
    check_factories(spec, prefixes)


@pytest.mark.parametrize(
    "factory", ["os:system", "subprocess:run", "ipnext_evil.parts:Part", "tests.bad_parts:exits"]
)
def test_a_factory_outside_the_list_is_refused_naming_the_field_value_and_setting(
    example_spec: ModelSpec, factory: str
) -> None:
    with pytest.raises(SpecError) as info:
        check_factories_allowed(with_factory(example_spec, "dense", factory), ["ipnext."])
    err = info.value
    assert err.field == "parts.dense.factory"
    assert err.value == factory
    assert f"parts.dense.factory: {factory!r} is outside" in str(err)
    assert "model_code.factory_prefixes" in str(err) and "nothing was imported" in str(err)


def test_an_allowed_module_cannot_lend_a_callable_defined_elsewhere(example_spec: ModelSpec) -> None:
    """ipnext.spec.model imports pydantic's `Field`: allowed module, foreign code."""
    spec = with_factory(example_spec, "dense", "ipnext.spec.model:Field")
    check_factories_allowed(spec, ["ipnext."])  # the module path alone passes
    with pytest.raises(SpecError, match=r"parts\.dense\.factory: .*defined in 'pydantic\.fields', outside"):
        check_factories(spec, ["ipnext."])
    check_factories(spec)  # without the list (the serving side), resolving is all


def test_the_setting_refuses_prefixes_that_would_allow_everything() -> None:
    for bad in ["", ".", "ipnext..", "os system", "*"]:
        with pytest.raises(ValueError):
            ModelCodeSettings(factory_prefixes=[bad])
    with pytest.raises(ValueError):
        ModelCodeSettings(factory_prefixes=[])


def test_the_operator_adds_prefixes_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPNEXT_MODEL_CODE__FACTORY_PREFIXES", '["ipnext.", "acme.parts"]')
    assert Settings().model_code.factory_prefixes == ["ipnext.", "acme.parts"]


def test_the_repo_config_spells_out_the_default() -> None:
    from ipnext.spec.settings import load_settings

    code = load_settings(REPO / "config" / "ipnext.yaml").model_code
    assert code == ModelCodeSettings()


@pytest.mark.parametrize(
    "factory",
    [
        "ipnext.client.cli:main",  # the platform's own callables: CLI, dev stack, keys
        "ipnext.client.devstack.stack:DevStack",
        "ipnext.store.keys:add_key",
        "ipnext.serving.llm.engine:Engine",  # the LLM package beyond its part module
        "ipnext.examplesx.parts:Part",
    ],
)
def test_the_default_admits_no_other_platform_code(example_spec: ModelSpec, factory: str) -> None:
    with pytest.raises(SpecError, match="is outside the modules this worker may import"):
        check_factories_allowed(with_factory(example_spec, "dense", factory), DEFAULT_FACTORY_PREFIXES)


def test_the_default_admits_the_llm_part_and_the_examples() -> None:
    for factory in ["ipnext.serving.llm.part:LLMPart", "ipnext.examples.click_ranker.parts:DensePart"]:
        assert callable(import_factory(factory, DEFAULT_FACTORY_PREFIXES))


def test_with_the_list_a_module_outside_it_is_refused_before_its_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a replica does with its config's list (`PartHostArgs.factory_prefixes`): the check
    comes before the import, so the module's code never runs."""
    marker = tmp_path / "imported"
    (tmp_path / "owner_mod_x1.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Part:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SpecError, match=r"module 'owner_mod_x1' is outside .*nothing was imported"):
        import_factory("owner_mod_x1:Part", DEFAULT_FACTORY_PREFIXES)
    assert not marker.exists()
    import_factory("owner_mod_x1:Part", ["owner_mod_x1"])
    assert marker.exists()


def test_a_replica_checks_the_list_again_before_importing_or_reading_weights(tmp_path: Path) -> None:
    """A Serve config naming a factory outside the worker's list (written by hand, or by another
    tool) fails the replica's start, before its module is imported or its weights are read."""
    from ipnext.serving.layout import PartHostArgs
    from ipnext.serving.set_app import PartHost

    host = PartHostArgs(
        model="m",
        part="p",
        factory="ipnext.client.cli:main",
        uri="file:///nowhere/weights.safetensors",
        sha256="0" * 64,
        snapshot_id="m/p@v1",
        pinned_store=str(tmp_path / "no-store"),
    )
    with pytest.raises(SpecError, match=r"module 'ipnext\.client\.cli' is outside"):
        PartHost.func_or_class(host)  # type: ignore[attr-defined]
