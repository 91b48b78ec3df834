"""Mixed precision: autocast contexts, fp32-kept modules, gradient scaler, FSDP2 policy.

* ``fp32``: nothing changes.
* ``bf16``: autocast to bfloat16 (DDP/single/pipeline); for FSDP/HSDP the FSDP2
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` casts the unsharded
  parameters instead (no autocast needed), modules in ``keep_fp32`` become their own FSDP
  units with an fp32 policy.
* ``fp16``: like bf16 plus a ``torch.amp.GradScaler`` (dynamic loss scaling).

``keep_fp32`` entries are fnmatch patterns or plain substrings of module names; a kept
module runs with autocast disabled and its floating inputs cast to float32.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matches(name: str, patterns: list[str]) -> bool:
    """True if module ``name`` matches any fnmatch pattern or contains it as a substring."""
    leaf = name.rsplit(".", 1)[-1]
    return any(
        fnmatch.fnmatch(name, p) or fnmatch.fnmatch(leaf, p) or (p and p in leaf)
        for p in patterns
    )


def kept_modules(model: nn.Module, patterns: list[str]) -> list[tuple[str, nn.Module]]:
    """Outermost modules whose name matches ``patterns`` (children of a kept one skipped)."""
    out: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if not name or any(name.startswith(n + ".") for n, _ in out):
            continue
        if matches(name, patterns):
            out.append((name, mod))
    return out


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.float()
    if isinstance(x, tuple | list):
        return type(x)(_to_fp32(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_fp32(v) for k, v in x.items()}
    return x


def _cast(dtype: torch.dtype) -> Any:
    def f(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        if isinstance(x, tuple | list):
            return type(x)(f(v) for v in x)
        if isinstance(x, dict):
            return {k: f(v) for k, v in x.items()}
        return x

    return f


def keep_in_fp32(model: nn.Module, patterns: list[str], device_type: str) -> list[str]:
    """Make matching modules run in fp32 under autocast; returns their names."""
    names = []
    for name, mod in kept_modules(model, patterns):
        orig = mod.forward

        @functools.wraps(orig)
        def fwd(*args: Any, __orig: Any = orig, __mod: nn.Module = mod, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, enabled=False):
                p = next((q for q in __mod.parameters() if q.is_floating_point()), None)
                if p is not None and p.dtype != torch.float32:  # FSDP cast the params
                    cast = _cast(p.dtype)
                    return __orig(*cast(args), **cast(kwargs))
                return __orig(*_to_fp32(args), **_to_fp32(kwargs))

        mod.forward = fwd  # instance attribute: nn.Module.__call__ uses it
        names.append(name)
    return names


@contextlib.contextmanager
def autocast(dtype: str, device_type: str, enabled: bool = True) -> Iterator[None]:
    """Autocast to ``dtype`` on ``device_type`` (no-op for fp32 or when disabled)."""
    if dtype == "fp32" or not enabled:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=DTYPES[dtype]):
        yield


def grad_scaler(dtype: str, device_type: str, init_scale: float) -> Any:
    """A GradScaler for fp16, else None."""
    if dtype != "fp16":
        return None
    return torch.amp.GradScaler(device_type, init_scale=init_scale)


def fsdp_policy(dtype: str, reduce: str = "fp32") -> Any:
    """FSDP2 MixedPrecisionPolicy for ``dtype`` (params cast, grads reduced in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "fp32":
        return MixedPrecisionPolicy()
    pd = DTYPES[dtype]
    return MixedPrecisionPolicy(
        param_dtype=pd, reduce_dtype=torch.float32 if reduce == "fp32" else pd
    )


def fsdp_fp32_policy() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
