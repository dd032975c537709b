"""Builds each Triton kernel twice, compiled for CUDA tensors and interpreted for CPU tensors,
with autotuning.

`triton.jit` decides between the two from TRITON_INTERPRET when a kernel is defined, so under
`make test` (which exports it) a GPU would run interpreted, where bfloat16 is computed wrongly.
Building both forms explicitly lets the tensors' device pick the form per call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# A filter over the configs of the device's list, given the launch's arguments (False drops the config).
ConfigFit = Callable[[triton.Config, dict[str, Any]], bool]


@dataclass(frozen=True)
class ConfigLists:
    """Explicit configs per architecture; `interpreter` is the one small config used on CPU."""

    hopper: Sequence[triton.Config]  # sm90 and newer
    ampere: Sequence[triton.Config]  # sm80 to sm89, and older GPUs
    interpreter: triton.Config

    def all(self) -> list[triton.Config]:
        return [*self.hopper, *self.ampere, self.interpreter]


class TunedKernel:
    """One kernel's source, turned into an autotuned launcher per form on first use."""

    def __init__(
        self,
        fn: Callable[..., None],
        *,
        configs: ConfigLists,
        key: Sequence[str],
        device_arg: str,
        fit: ConfigFit | None = None,
        do_not_specialize: Sequence[str] = (),
    ) -> None:
        self._fn = fn
        self._configs = configs
        self._key = list(key)
        self._device_arg = device_arg
        self._fit = fit
        self._do_not_specialize = list(do_not_specialize)
        self._launchers: dict[bool, Any] = {}

    def __getitem__(self, grid: Callable[[dict[str, Any]], tuple[int, ...]]) -> Callable[..., None]:
        """`kernel[grid](*args)`, as with a plain Triton kernel; the first tensor's device picks the form."""

        def launch(*args: Any, **kwargs: Any) -> None:
            device = args[0].device
            interpreted = device.type != "cuda"
            if interpreted not in self._launchers:
                self._launchers[interpreted] = self._build(interpreted)
            self._launchers[interpreted][grid](*args, **kwargs)

        return launch

    def _build(self, interpreted: bool) -> Any:
        form = InterpretedFunction if interpreted else JITFunction
        fn = form(self._fn, do_not_specialize=self._do_not_specialize)

        def prune(
            configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
        ) -> list[triton.Config]:
            return self._pick(configs, {**named_args, **kwargs}, interpreted)

        return triton.autotune(
            configs=self._configs.all(), key=self._key, prune_configs_by={"early_config_prune": prune}
        )(fn)

    def _pick(
        self, configs: list[triton.Config], named_args: dict[str, Any], interpreted: bool
    ) -> list[triton.Config]:
        if interpreted:
            # The autotuner benchmarks through a GPU driver, so the interpreter gets exactly one config.
            chosen: Sequence[triton.Config] = [self._configs.interpreter]
        else:
            major, _ = torch.cuda.get_device_capability(named_args[self._device_arg].device)
            chosen = self._configs.hopper if major >= 9 else self._configs.ampere
            if self._fit is not None:
                fitting = [c for c in chosen if self._fit(c, named_args)]
                chosen = fitting or chosen
        wanted = {id(c) for c in chosen}
        return [c for c in configs if id(c) in wanted]


def bucket(n: int, *, low: int = 16, high: int = 1 << 16) -> int:
    """A power of two near n, for autotune keys: one tuning per size class, not per exact length."""
    return max(low, min(high, triton.next_power_of_2(max(n, 1))))
