from __future__ import annotations

import pytest

from kvpilot.operator.model_source import SpecError, resolve_model_source


def test_pvc_mounts_the_claim_read_only_and_points_into_it() -> None:
    source = resolve_model_source("pvc://models/llama-3-8b/instruct")
    assert source.model_arg == "/models/llama-3-8b/instruct"
    assert source.volume == {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert source.mount_path == "/models"


def test_pvc_without_path_serves_the_claim_root() -> None:
    assert resolve_model_source("pvc://models").model_arg == "/models"


def test_host_path_mounts_the_file_or_folder_by_its_basename() -> None:
    source = resolve_model_source("hostpath:///mnt/weights/smol.gguf")
    assert source.model_arg == "/models/smol.gguf"
    assert source.volume == {"name": "model", "hostPath": {"path": "/mnt/weights/smol.gguf"}}


def test_preset_has_no_volume() -> None:
    source = resolve_model_source("preset://llama-2-70b")
    assert (source.model_arg, source.volume, source.is_preset) == ("llama-2-70b", None, True)


def test_embedded_passes_no_model() -> None:
    assert resolve_model_source("embedded").model_arg is None


@pytest.mark.parametrize(("source", "message"), [
    ("s3://bucket/llama", "unsupported scheme 's3://'"),
    ("hf://meta-llama/Llama-3", "unsupported scheme 'hf://'"),
    ("pvc://Bad_Claim/x", "not a valid PersistentVolumeClaim name"),
    ("pvc://models/../etc", "may not contain '..'"),
    ("hostpath://relative/path", "absolute path"),
    ("hostpath:///", "below /"),
    ("preset://bad name", "preset name"),
    ("llama", "not a URI"),
])
def test_sources_that_cannot_work_are_spec_errors(source: str, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace(".", r"\.").replace("(", r"\(")):
        resolve_model_source(source)
