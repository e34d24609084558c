"""The machine a result came from: speedups from one accelerator, dtype or library version
say little about another, so every `results.json` carries its own."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import transformers


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _cpu_name() -> str:
    """`platform.processor()` is empty or just `x86_64` on most Linux systems; the kernel knows
    the model name."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_name()


def machine_info(model) -> dict[str, Any]:
    return {
        "device": str(model.device),
        "device_name": device_name(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_selfspec": _package_version("hf-selfspec"),
    }
