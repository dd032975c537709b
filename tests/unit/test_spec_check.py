"""The factory check and the part build in a forked process of the warm checker, with its time
and memory limits: the real processes, with real modules on their path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from ipnext.activities import _context, spec_check
from ipnext.activities.spec_check import CheckerError, check_factories_in_child, check_part_in_child
from ipnext.activities.validate import ValidateSetInput, validate_model_spec, validate_snapshot_set
from ipnext.contracts.model import ValidateSpecInput
from ipnext.errors import SnapshotError, SpecError
from ipnext.names import wait_until
from ipnext.spec.model import ModelSpec
from ipnext.spec.settings import ModelCodeSettings, Settings
from tests.unit.helpers import DEV_FLEET, Trained

GIB = 1024**3
# The repo's own modules, and this suite's misbehaving parts (tests/bad_parts.py).
PREFIXES = ["ipnext.", "tests.bad_parts"]


def with_factory(spec: ModelSpec, factory: str) -> ModelSpec:
    data = spec.model_dump(mode="json")
    data["parts"]["embed"]["factory"] = factory
    return ModelSpec.model_validate(data)


@pytest.fixture(scope="module")
def owner_code(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder on the checks' import path (the checker inherits the environment), not on
    ours; one per module, so its tests share one warm checker. Module names differ per test."""
    folder = tmp_path_factory.mktemp("owner_code")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(folder))
        yield folder


def test_the_example_factories_pass(example_spec: ModelSpec) -> None:
    check_factories_in_child(example_spec)


def test_a_missing_module_is_named_with_its_part(example_spec: ModelSpec) -> None:
    with pytest.raises(SpecError, match=r"parts\.embed\.factory: .*'no_such_module_xyz' does not import"):
        check_factories_in_child(with_factory(example_spec, "no_such_module_xyz:Part"))
    assert "no_such_module_xyz" not in sys.modules


def test_the_owners_code_runs_in_the_child_only(example_spec: ModelSpec, owner_code: Path) -> None:
    (owner_code / "noisy_parts.py").write_text("print('hello from import')\nPart = object\n")
    check_factories_in_child(with_factory(example_spec, "noisy_parts:Part"))  # its print is not the answer
    assert "noisy_parts" not in sys.modules


def test_a_module_that_exits_or_hangs_is_refused(example_spec: ModelSpec, owner_code: Path) -> None:
    (owner_code / "exits.py").write_text("import os\nos._exit(3)\n")
    with pytest.raises(SpecError, match="ended with code 3 and no answer"):
        check_factories_in_child(with_factory(example_spec, "exits:Part"))
    (owner_code / "hangs.py").write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(SpecError, match="did not finish within 2 s"):
        check_factories_in_child(with_factory(example_spec, "hangs:Part"), timeout_s=2)


def test_a_factory_that_is_not_callable_is_refused(example_spec: ModelSpec, owner_code: Path) -> None:
    (owner_code / "plain.py").write_text("Part = 3\n")
    with pytest.raises(SpecError, match=r"parts\.embed\.factory: .*has no callable 'Part'"):
        check_factories_in_child(with_factory(example_spec, "plain:Part"))


def checker_pid() -> int:
    current = spec_check._current
    assert current is not None, "no checker running"
    return current.process.pid


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may take a moment)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_checks_share_one_warm_checker_and_see_the_owners_code_as_it_is_now(
    example_spec: ModelSpec, owner_code: Path
) -> None:
    (owner_code / "changing.py").write_text("Part = object\n")
    check_factories_in_child(with_factory(example_spec, "changing:Part"))
    first = checker_pid()
    (owner_code / "changing.py").write_text("Part = 3\n")  # the checker never imported it
    with pytest.raises(SpecError, match="has no callable 'Part'"):
        check_factories_in_child(with_factory(example_spec, "changing:Part"))
    (owner_code / "added_later.py").write_text("Part = object\n")  # written after the checker started
    check_factories_in_child(with_factory(example_spec, "added_later:Part"))
    assert checker_pid() == first  # one process did all three


def test_a_changed_import_path_or_a_dead_checker_gets_a_new_checker(
    example_spec: ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_factories_in_child(example_spec)
    first = checker_pid()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the worker's path changed: so does the check's
    (tmp_path / "only_here.py").write_text("Part = object\n")
    check_factories_in_child(with_factory(example_spec, "only_here:Part"))
    second = checker_pid()
    assert second != first
    wait_until(lambda: running(first), lambda alive: not alive, timeout_s=10, interval_s=0.05)
    os.kill(second, signal.SIGKILL)
    wait_until(lambda: running(second), lambda alive: not alive, timeout_s=10, interval_s=0.05)
    check_factories_in_child(with_factory(example_spec, "only_here:Part"))
    assert checker_pid() not in (first, second)


def test_a_hanging_check_does_not_hold_up_another(example_spec: ModelSpec, owner_code: Path) -> None:
    started, release = owner_code / "slow-started", owner_code / "slow-release"
    (owner_code / "slow.py").write_text(
        "import os, time\n"
        f"open({str(started)!r}, 'w').close()\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.02)\n"
        "Part = object\n"
    )
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            check_factories_in_child(with_factory(example_spec, "slow:Part"), timeout_s=120)
        except BaseException as err:
            errors.append(err)

    waiting = threading.Thread(target=slow)
    waiting.start()
    wait_until(started.exists, bool, timeout_s=120, interval_s=0.02)  # the slow import is running
    check_factories_in_child(example_spec)  # answered while the slow one cannot finish
    assert waiting.is_alive()
    release.touch()
    waiting.join()
    assert errors == []


def test_a_supervisor_killed_mid_check_is_a_checker_error_not_a_spec_error(
    example_spec: ModelSpec, owner_code: Path
) -> None:
    (owner_code / "kills_parent.py").write_text(
        # It sleeps on after killing its parent: the check ends on that death, never on an answer.
        "import os, signal, time\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(3)\n"
    )
    with pytest.raises(CheckerError, match="ended without an answer"):
        check_factories_in_child(with_factory(example_spec, "kills_parent:Part"))


def test_the_checker_never_outlives_its_worker(tmp_path: Path) -> None:
    pid_file = tmp_path / "checker.pid"
    worker = (
        "import os, signal, sys\n"
        "from ipnext.activities import spec_check\n"
        "spec_check.start_checker()\n"
        f"open({str(pid_file)!r}, 'w').write(str(spec_check._current.process.pid))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", worker], timeout=120, check=False)
    assert done.returncode == -signal.SIGKILL
    orphan = int(pid_file.read_text())
    wait_until(lambda: running(orphan), lambda alive: not alive, timeout_s=10, interval_s=0.05)
    spec_check.stop_checker()  # and ours ends when asked


# ---- building a part with its weights, under the limits -------------------------------------


def build(spec: ModelSpec, trained: Trained, factory: str, **limits: float) -> None:
    """Build the embed part from the trained snapshot with `factory`, in a child: 1 GiB, 30 s."""
    ref = trained.request.parts["embed"]
    pinned = trained.folder / "embed.safetensors"
    timeout_s = limits.get("timeout_s", 30.0)
    memory = int(limits.get("memory_bytes", GIB))
    check_part_in_child(with_factory(spec, factory), "embed", ref, pinned, timeout_s, memory, PREFIXES)


def test_the_example_parts_build_in_the_child_within_1_gib(example_spec: ModelSpec, trained: Trained) -> None:
    for part, ref in sorted(trained.request.parts.items()):
        started = time.perf_counter()
        check_part_in_child(
            example_spec, part, ref, trained.folder / f"{part}.safetensors", 30, GIB, PREFIXES
        )
        print(f"{part} built in the child in {time.perf_counter() - started:.2f} s")


def test_weights_that_do_not_fit_are_still_a_snapshot_error(
    example_spec: ModelSpec, trained: Trained
) -> None:
    ref = trained.request.parts["embed"]
    with pytest.raises(SnapshotError, match=r"parts\.dense \(.*\): tensors do not fit the part"):
        check_part_in_child(
            example_spec, "dense", ref, trained.folder / "embed.safetensors", 30, GIB, PREFIXES
        )


def test_a_part_that_sleeps_forever_is_killed_at_the_timeout(
    example_spec: ModelSpec, trained: Trained
) -> None:
    started = time.perf_counter()
    with pytest.raises(SpecError, match=r"building part embed with snapshot .* did not finish within 3 s"):
        build(example_spec, trained, "tests.bad_parts:sleeps_forever", timeout_s=3)
    print(f"refused after {time.perf_counter() - started:.2f} s")
    build(example_spec, trained, "ipnext.examples.click_ranker.parts:EmbeddingPart")  # the checker lives on


def test_a_part_that_allocates_twice_the_limit_runs_out_of_memory(
    example_spec: ModelSpec, trained: Trained
) -> None:
    """tests.bad_parts:allocates touches 2 GiB page by page; the check may hold 1 GiB."""
    started = time.perf_counter()
    with pytest.raises(SpecError, match=r"building part embed .* ran out of memory: the check may use 1 GiB"):
        build(example_spec, trained, "tests.bad_parts:allocates", memory_bytes=GIB)
    print(f"refused after {time.perf_counter() - started:.2f} s")
    build(example_spec, trained, "ipnext.examples.click_ranker.parts:EmbeddingPart")


def test_torchs_own_out_of_memory_error_is_named_as_such(example_spec: ModelSpec, trained: Trained) -> None:
    with pytest.raises(SpecError, match=r"ran out of memory: .* \(.*RuntimeError: .*can't allocate memory"):
        build(example_spec, trained, "tests.bad_parts:torch_allocates", memory_bytes=GIB)


def test_a_part_killed_by_a_signal_is_refused_naming_it(example_spec: ModelSpec, trained: Trained) -> None:
    with pytest.raises(
        SpecError, match=r"was killed by SIGKILL \(the kernel's out-of-memory killer, or an operator\)"
    ):
        build(example_spec, trained, "tests.bad_parts:killed")


def test_a_part_that_exits_the_process_is_refused(example_spec: ModelSpec, trained: Trained) -> None:
    with pytest.raises(
        SpecError, match=r"building part embed .*: the check process ended with code 7 and no answer"
    ):
        build(example_spec, trained, "tests.bad_parts:exits")


def test_an_import_that_allocates_without_bound_runs_out_of_memory(
    example_spec: ModelSpec, owner_code: Path
) -> None:
    (owner_code / "greedy.py").write_text("hoard = [bytearray(2**26) for _ in range(32)]\nPart = object\n")
    with pytest.raises(
        SpecError, match=r"importing its factories ran out of memory: the check may use 1 GiB"
    ):
        check_factories_in_child(with_factory(example_spec, "greedy:Part"), 30, GIB)


# ---- the allow-list, decided in the worker before anything imports ---------------------------


@pytest.fixture
def worker_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The activity's settings: the repo's fleet, the default allow-list, short limits."""
    settings = Settings(
        fleet_file=DEV_FLEET,
        model_code=ModelCodeSettings(validation_timeout_s=30, validation_memory_bytes=GIB),
    )
    monkeypatch.setattr(_context, "settings", lambda: settings)
    return settings


@pytest.mark.parametrize("factory", ["os:system", "{owner}:Part"])
def test_a_factory_outside_the_list_is_refused_before_it_is_imported(
    example_spec: ModelSpec, owner_code: Path, worker_settings: Settings, factory: str
) -> None:
    owner = f"marks_on_import_{uuid.uuid4().hex[:8]}"  # a module of the owner's that leaves a mark
    marker = owner_code / f"{owner}.imported"
    (owner_code / f"{owner}.py").write_text(f"open({str(marker)!r}, 'w').close()\nPart = object\n")
    factory = factory.format(owner=owner)
    with pytest.raises(ApplicationError) as info:
        validate_model_spec(ValidateSpecInput(spec=with_factory(example_spec, factory)))
    assert info.value.type == "SpecError" and info.value.non_retryable
    assert f"parts.embed.factory: {factory!r} is outside" in str(info.value)
    assert "model_code.factory_prefixes: ['ipnext.examples.', 'ipnext.serving.llm.part']" in str(info.value)
    assert not marker.exists()
    check_factories_in_child(with_factory(example_spec, f"{owner}:Part"))  # the module itself imports
    assert marker.exists()


def test_the_activity_passes_an_allowed_spec(example_spec: ModelSpec, worker_settings: Settings) -> None:
    validate_model_spec(ValidateSpecInput(spec=example_spec))


def test_a_sets_builds_share_one_timeout_and_the_refusal_says_so(
    example_spec: ModelSpec, trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot publish's activity: pinned in the worker, built in the child, refused."""
    settings = Settings(
        fleet_file=DEV_FLEET,
        snapshot_roots=[trained.root],
        state_dir=tmp_path,
        model_code=ModelCodeSettings(
            factory_prefixes=PREFIXES, validation_timeout_s=3, validation_memory_bytes=GIB
        ),
    )
    monkeypatch.setattr(_context, "settings", lambda: settings)
    spec = with_factory(example_spec, "tests.bad_parts:sleeps_forever")
    with pytest.raises(ApplicationError) as info:
        ActivityEnvironment().run(validate_snapshot_set, ValidateSetInput(spec=spec, request=trained.request))
    assert info.value.type == "SpecError" and info.value.non_retryable
    assert "building part embed with snapshot" in str(info.value)
    assert "what was left of the set's 3 s, model_code.validation_timeout_s" in str(info.value)
    done = ActivityEnvironment().run(
        validate_snapshot_set, ValidateSetInput(spec=example_spec, request=trained.request)
    )
    assert sorted(done.parts) == ["dense", "embed"]
