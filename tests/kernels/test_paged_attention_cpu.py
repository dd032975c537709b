"""The compiled C path of paged decode attention (CPU, float32): against the float64 reference over the
layouts, head sizes, windows and thread counts, which calls take it, and what happens where it cannot
be built (no compiler, a compile error, switched off): the torch reference answers, and says why once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ipnext.kernels import _cpu_build, _paged_attention, paged_attention, paged_attention_reference
from tests.kernels.helpers import HEAD_DIMS, as_float64, assert_matches
from tests.kernels.test_paged_attention import CONTEXT_LENS, LAYOUTS, paged_inputs

pytestmark = pytest.mark.timeout(120)  # the first call compiles (about a second)

SOURCE = "_paged_attention_cpu.c"


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache and no library loaded yet, so the next call builds from nothing."""
    tmp_path.chmod(0o700)  # the cache must be private (whatever the umask made it)
    monkeypatch.setenv(_cpu_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_cpu_build, "_loaded", {})
    monkeypatch.setattr(_paged_attention, "_cpu_function", [])
    yield tmp_path


def run_c(*args: torch.Tensor, window: int | None = None) -> torch.Tensor:
    kernel = _paged_attention._cpu_kernel()
    assert kernel is not None, "the C kernel did not build: is a C compiler (cc) on PATH?"
    scale = args[0].shape[2] ** -0.5
    return _paged_attention._run_cpu(kernel, *args, window, scale)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 1, 9, 200])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_c_kernel_matches_the_float64_reference(
    layout: str, head_dim: int, window: int | None, threads: int
) -> None:
    """Table entries past each context are -1 (paged_inputs), so a read past the context would crash
    or show; lengths are ragged, one is 0, windows cut inside blocks and across them."""
    q, k_cache, v_cache, table, lens = paged_inputs(*LAYOUTS[layout], head_dim, torch.float32, "cpu", seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run_c(q, k_cache, v_cache, table, lens, window=window)
    finally:
        torch.set_num_threads(before)
    q64, k64, v64 = as_float64(q, k_cache, v_cache)
    expected = paged_attention_reference(q64, k64, v64, table, lens, window=window)
    assert_matches(out, expected, torch.float32)
    empty = CONTEXT_LENS.index(0)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


def test_cpu_float32_calls_take_the_c_kernel_and_backend_torch_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = _paged_attention._run_cpu
    monkeypatch.setattr(_paged_attention, "_run_cpu", lambda *a: calls.append(1) or real(*a))
    args = paged_inputs(4, 2, 16, 32, torch.float32, "cpu")
    by_default = paged_attention(*args)
    assert calls == [1]
    forced = paged_attention(*args, backend="torch")
    assert calls == [1]
    assert torch.equal(forced, paged_attention_reference(*args))
    torch.testing.assert_close(by_default, forced, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_dtypes_run_the_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_paged_attention, "_run_cpu", lambda *a: pytest.fail("the C kernel ran"))
    args = paged_inputs(4, 2, 16, 32, dtype, "cpu")
    assert torch.equal(paged_attention(*args), paged_attention_reference(*args))


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_cpu_build.ENABLE_ENV, "0")
    monkeypatch.setattr(_paged_attention, "_run_cpu", lambda *a: pytest.fail("the C kernel ran"))
    args = paged_inputs(4, 2, 16, 32, torch.float32, "cpu")
    assert torch.equal(paged_attention(*args), paged_attention_reference(*args))


def test_without_a_compiler_the_reference_answers_and_the_log_says_why(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-ipnext")
    args = paged_inputs(4, 2, 16, 32, torch.float32, "cpu")
    with caplog.at_level(logging.WARNING, logger=_cpu_build.__name__):
        first = paged_attention(*args)
        second = paged_attention(*args)
    assert torch.equal(first, paged_attention_reference(*args)) and torch.equal(second, first)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no C compiler 'no-such-compiler-ipnext'" in warnings[0]
    assert list(fresh_build.iterdir()) == []


def test_a_compile_error_leaves_no_library_behind(
    fresh_build: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    broken = tmp_path_factory.mktemp("src") / "broken.c"
    broken.write_text("int this is not C;\n")
    with pytest.raises(RuntimeError, match=r"failed on broken\.c"):
        _cpu_build.build(broken)
    assert list(fresh_build.iterdir()) == []


def test_the_library_is_built_once_per_source_and_cached(
    fresh_build: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("src")
    source = folder / "tiny.c"
    source.write_text("int ipnext_answer(void) { return 42; }\n")
    built = _cpu_build.build(source)
    stamp = built.stat().st_mtime_ns
    assert _cpu_build.build(source) == built and built.stat().st_mtime_ns == stamp  # not compiled again
    source.write_text("int ipnext_answer(void) { return 43; }\n")
    rebuilt = _cpu_build.build(source)
    assert rebuilt != built and sorted(p.name for p in fresh_build.iterdir()) == sorted(
        [built.name, rebuilt.name]
    )


@pytest.mark.parametrize("loose", ["folder", "library"])
def test_a_cache_others_can_write_is_refused_and_the_reference_answers(
    fresh_build: Path, tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture, loose: str
) -> None:
    """Loading a library runs its code: a cache folder, or a library in it, that a group or other
    users may write is not loaded from (nor compiled into), and the caller keeps the reference."""
    source = tmp_path_factory.mktemp("src") / "tiny.c"
    source.write_text("int ipnext_answer(void) { return 42; }\n")
    _cpu_build.build(source)
    _cpu_build.build(Path(_cpu_build.__file__).with_name(SOURCE))  # the real kernel's, for the call below
    if loose == "folder":
        fresh_build.chmod(0o777)
    else:
        for library in fresh_build.iterdir():
            library.chmod(0o666)
    with pytest.raises(PermissionError, match=r"no group or other user can write.*chmod go-w"):
        _cpu_build.build(source)
    args = paged_inputs(4, 2, 16, 32, torch.float32, "cpu")
    with caplog.at_level(logging.WARNING, logger=_cpu_build.__name__):
        assert torch.equal(paged_attention(*args), paged_attention_reference(*args))
    assert any("kernel cache" in r.getMessage() for r in caplog.records)


def test_a_fresh_build_serves_the_kernel(fresh_build: Path) -> None:
    args = paged_inputs(8, 2, 16, 64, torch.float32, "cpu", seed=1)
    out = paged_attention(*args)
    assert [p.name.startswith("_paged_attention_cpu-") for p in fresh_build.iterdir()] == [True]
    torch.testing.assert_close(out, paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


def test_scores_far_apart_underflow_to_zero_weights_as_in_the_reference() -> None:
    """Queries 30 times larger: most weights are exp of less than -87 (the kernel's own exp gives 0
    there) and each sequence's answer is nearly one value row."""
    q, k_cache, v_cache, table, lens = paged_inputs(4, 2, 16, 64, torch.float32, "cpu", seed=9)
    q = q * 30
    out = run_c(q, k_cache, v_cache, table, lens)
    q64, k64, v64 = as_float64(q, k_cache, v_cache)
    assert_matches(out, paged_attention_reference(q64, k64, v64, table, lens), torch.float32)
