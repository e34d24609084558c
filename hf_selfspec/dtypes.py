"""Which dtype a model runs in: a dtype's name read, and `"auto"` settled for this device."""

from __future__ import annotations

import logging
import platform

import torch

AUTO = "auto"

logger = logging.getLogger(__name__)


def parse_dtype(name: str | torch.dtype) -> torch.dtype | str:
    """A torch dtype, or `"auto"`: the checkpoint's own dtype, as transformers means it."""
    if isinstance(name, torch.dtype) or name == AUTO:
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return dtype


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_amx() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in tiles (the `amx_bf16` flag), read from
    the same flags as `has_native_bfloat16`."""
    return "amx_bf16" in _cpu_flags()


def has_native_bfloat16(device: str | torch.device) -> bool:
    """Whether bfloat16 matrix products run in hardware here.

    On a CPU without bfloat16 dot products (the avx512_bf16 or amx_bf16 flags on x86, bf16 on Arm) torch
    emulates them, several times slower than float32; with them, bfloat16 verifies a k-token
    draft for about the price of one token, which is what speculation needs.
    """
    device = torch.device(device)
    if device.type == "cuda":
        # Ampere and later; is_bf16_supported() also says yes where it is only emulated (V100, T4).
        return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type != "cpu":
        return True
    flags = _cpu_flags()
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def settle_auto_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """After a `dtype="auto"` load: keep the checkpoint's dtype unless it is bfloat16 on a device
    that would only emulate it, where float32 is faster and exact."""
    if model.dtype == torch.bfloat16 and not has_native_bfloat16(model.device):
        logger.warning(
            "dtype=auto: the checkpoint is bfloat16 but this %s has no native bfloat16 dot products; "
            "running in float32 instead.",
            model.device.type.upper(),
        )
        model = model.float()
    return model
