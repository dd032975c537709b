"""Which path each call takes (`backend=`), what happens where Triton cannot run, and the input checks:
every bad argument is a ValueError whose message starts with the argument's name
and says what was expected."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton

from ipnext import kernels
from ipnext.kernels import (
    KernelBackendError,
    KernelInputError,
    _attention,
    _grouped_gemm,
    _paged_attention,
    attention,
    attention_reference,
    grouped_gemm,
    grouped_gemm_reference,
    paged_attention,
    paged_attention_reference,
)

pytestmark = pytest.mark.timeout(60)

rng = torch.Generator().manual_seed(0)


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=rng).to(device, dtype)


def attention_args(**change: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"q": randn(2, 4, 5, 32), "k": randn(2, 2, 9, 32), "v": randn(2, 2, 9, 32)}
    return {**args, **change}


def paged_args(**change: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "q": randn(2, 4, 32),
        "k_cache": randn(6, 2, 8, 32),
        "v_cache": randn(6, 2, 8, 32),
        "block_table": torch.tensor([[5, 0, -1], [3, 1, 2]], dtype=torch.int32),
        "context_lens": torch.tensor([10, 24], dtype=torch.int32),
    }
    return {**args, **change}


def gemm_args(**change: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"a": [randn(3, 8), randn(1, 5)], "b": [randn(8, 6), randn(5, 7)]}
    return {**args, **change}


# name -> (public function, its reference, the module whose _launch runs the kernel, its arguments)
KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., Any], Any, Callable[[], dict[str, Any]]]] = {
    "attention": (attention, attention_reference, _attention, attention_args),
    "paged_attention": (paged_attention, paged_attention_reference, _paged_attention, paged_args),
    "grouped_gemm": (grouped_gemm, grouped_gemm_reference, _grouped_gemm, gemm_args),
}


def same(got: Any, want: Any) -> bool:
    if isinstance(got, list):
        return len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    return torch.equal(got, want)


def test_triton_is_importable_and_cpu_kernels_may_be_interpreted() -> None:
    # The kernel tests run on CPU through the interpreter; `make test` sets this for the whole run.
    assert triton.__version__
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), (
        "run the kernel tests with TRITON_INTERPRET=1 (as `make test` does), or on a GPU"
    )


def test_the_public_surface() -> None:
    assert set(kernels.__all__) == {
        "KernelBackendError",
        "KernelInputError",
        "attention",
        "attention_reference",
        "grouped_gemm",
        "grouped_gemm_reference",
        "paged_attention",
        "paged_attention_reference",
    }
    assert issubclass(KernelInputError, ValueError)


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("name", KERNELS)
def test_cpu_default_and_torch_backend_run_the_reference_not_triton(
    name: str, backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    function, reference, module, make_args = KERNELS[name]

    def no_triton(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the Triton kernel was launched")

    monkeypatch.setattr(module, "_launch", no_triton)
    args = make_args()
    if name == "paged_attention" and backend is None:
        # float32 on CPU takes the compiled C kernel (test_paged_attention_cpu): equal within rounding.
        torch.testing.assert_close(function(**args, backend=backend), reference(**args), atol=1e-5, rtol=1e-5)
    else:
        assert same(function(**args, backend=backend), reference(**args))


@pytest.mark.parametrize("name", KERNELS)
def test_triton_backend_launches_the_kernel_on_cpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    function, _, module, make_args = KERNELS[name]
    launched = []
    real_launch = module._launch
    monkeypatch.setattr(module, "_launch", lambda *a, **k: launched.append(real_launch(*a, **k)))
    function(**make_args(), backend="triton")
    assert len(launched) == 1


@pytest.mark.parametrize("name", KERNELS)
def test_an_unknown_backend_is_refused(name: str) -> None:
    function, _, _, make_args = KERNELS[name]
    with pytest.raises(ValueError, match=r"^backend: expected None, 'triton' or 'torch', got 'cuda'"):
        function(**make_args(), backend="cuda")


@pytest.mark.parametrize("name", KERNELS)
def test_triton_on_cpu_without_the_interpreter_raises(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    function, _, _, make_args = KERNELS[name]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelBackendError, match="TRITON_INTERPRET"):
        function(**make_args(), backend="triton")
    function(**make_args())  # the default still serves from the reference


@pytest.mark.parametrize("name", KERNELS)
def test_triton_backend_without_triton_raises(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    function, _, _, make_args = KERNELS[name]
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with pytest.raises(KernelBackendError, match="cannot be imported"):
        function(**make_args(), backend="triton")
    function(**make_args(), backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", KERNELS)
def test_cuda_default_runs_triton(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    function, _, module, make_args = KERNELS[name]
    launched = []
    real_launch = module._launch
    monkeypatch.setattr(module, "_launch", lambda *a, **k: launched.append(real_launch(*a, **k)))
    cuda_args = {
        key: [t.cuda() for t in value] if isinstance(value, list) else value.cuda()
        for key, value in make_args().items()
    }
    function(**cuda_args)
    assert len(launched) == 1


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


# (id, function, arguments, the argument the message must name, a fragment of the expected shape or range)
BAD_INPUTS: list[tuple[str, Callable[..., Any], dict[str, Any], str, str]] = [
    ("q-not-4d", attention, attention_args(q=randn(4, 5, 32)), "q", "(batch, heads, n_q, head_dim)"),
    ("q-not-a-tensor", attention, attention_args(q=[1.0]), "q", "a torch.Tensor"),
    ("q-int", attention, attention_args(q=torch.ones(2, 4, 5, 32, dtype=torch.int32)), "q", "float16"),
    ("q-float64", attention, attention_args(q=randn(2, 4, 5, 32, dtype=torch.float64)), "q", "float32"),
    ("head-dim-48", attention, attention_args(q=randn(2, 4, 5, 48)), "q", "16, 32, 64, 128"),
    (
        "k-batch",
        attention,
        attention_args(k=randn(1, 2, 9, 32)),
        "k",
        "(batch=2, kv_heads, n_kv, head_dim=32)",
    ),
    ("k-head-dim", attention, attention_args(k=randn(2, 2, 9, 16)), "k", "head_dim=32"),
    (
        "heads-do-not-divide",
        attention,
        attention_args(k=randn(2, 3, 9, 32), v=randn(2, 3, 9, 32)),
        "k",
        "dividing",
    ),
    ("k-dtype", attention, attention_args(k=randn(2, 2, 9, 32, dtype=torch.float16)), "k", "torch.float32"),
    ("k-device", attention, attention_args(k=meta(randn(2, 2, 9, 32))), "k", "device cpu"),
    ("no-keys", attention, attention_args(k=randn(2, 2, 0, 32), v=randn(2, 2, 0, 32)), "k", "n_kv >= 1"),
    ("v-shape", attention, attention_args(v=randn(2, 2, 8, 32)), "v", "(2, 2, 9, 32)"),
    (
        "causal-more-queries",
        attention,
        {**attention_args(q=randn(2, 4, 10, 32)), "causal": True},
        "q",
        "n_q <= n_kv",
    ),
    ("scale-text", attention, {**attention_args(), "scale": "0.1"}, "scale", "a float"),
    ("paged-q-4d", paged_attention, paged_args(q=randn(2, 4, 1, 32)), "q", "(num_seqs, heads, head_dim)"),
    ("cache-head-dim", paged_attention, paged_args(k_cache=randn(6, 2, 8, 16)), "k_cache", "head_dim=32"),
    (
        "cache-heads-do-not-divide",
        paged_attention,
        paged_args(k_cache=randn(6, 3, 8, 32), v_cache=randn(6, 3, 8, 32)),
        "k_cache",
        "dividing",
    ),
    ("v-cache-shape", paged_attention, paged_args(v_cache=randn(5, 2, 8, 32)), "v_cache", "(6, 2, 8, 32)"),
    (
        "cache-dtype",
        paged_attention,
        paged_args(v_cache=randn(6, 2, 8, 32, dtype=torch.float16)),
        "v_cache",
        "float32",
    ),
    (
        "table-int64",
        paged_attention,
        paged_args(block_table=torch.zeros(2, 3, dtype=torch.int64)),
        "block_table",
        "int32",
    ),
    (
        "table-rows",
        paged_attention,
        paged_args(block_table=torch.zeros(3, 3, dtype=torch.int32)),
        "block_table",
        "(num_seqs=2, max_blocks)",
    ),
    (
        "table-past-the-cache",
        paged_attention,
        paged_args(block_table=torch.tensor([[5, 0, -1], [3, 6, 2]], dtype=torch.int32)),
        "block_table",
        "block_table[1, 1] = 6",
    ),
    (
        "table-negative",
        paged_attention,
        paged_args(block_table=torch.tensor([[5, -1, -1], [3, 1, 2]], dtype=torch.int32)),
        "block_table",
        "[0, num_blocks=6)",
    ),
    (
        "lens-int64",
        paged_attention,
        paged_args(context_lens=torch.tensor([1, 2])),
        "context_lens",
        "(num_seqs=2,)",
    ),
    (
        "lens-past-the-table",
        paged_attention,
        paged_args(context_lens=torch.tensor([10, 25], dtype=torch.int32)),
        "context_lens",
        "max_blocks * block_size = 3 * 8 = 24",
    ),
    (
        "lens-negative",
        paged_attention,
        paged_args(context_lens=torch.tensor([-1, 2], dtype=torch.int32)),
        "context_lens",
        "context_lens[0] = -1",
    ),
    ("no-groups", grouped_gemm, {"a": [], "b": []}, "a", "at least one"),
    ("a-is-a-tensor", grouped_gemm, gemm_args(a=randn(3, 8)), "a", "a list"),
    ("b-count", grouped_gemm, gemm_args(b=[randn(8, 6)]), "b", "2 tensors"),
    ("k-mismatch", grouped_gemm, gemm_args(b=[randn(8, 6), randn(4, 7)]), "b[1]", "(k_1=5, n_1)"),
    ("a-3d", grouped_gemm, gemm_args(a=[randn(3, 8), randn(1, 1, 5)]), "a[1]", "(m_1, k_1)"),
    (
        "gemm-dtype",
        grouped_gemm,
        gemm_args(a=[randn(3, 8), randn(1, 5, dtype=torch.float16)]),
        "a[1]",
        "float32",
    ),
    ("gemm-device", grouped_gemm, gemm_args(b=[meta(randn(8, 6)), randn(5, 7)]), "b[0]", "device cpu"),
]


@pytest.mark.parametrize(
    ("function", "args", "name", "expected"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_input_is_a_value_error_naming_the_argument(
    function: Callable[..., Any], args: dict[str, Any], name: str, expected: str, backend: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(name)}: expected ") as raised:
        function(**args, backend=backend)
    assert expected in str(raised.value)
    assert isinstance(raised.value, KernelInputError) and raised.value.field == name
