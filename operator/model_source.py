"""Model sources: where a pod finds its weights, and the volume that brings them there.

`spec.model.source` is a URI the CRD only checks for shape; its scheme is checked here, so a
source the schema lets through but that cannot work (`s3://...`) becomes a `SpecError`, which
the handlers surface as a Degraded condition, a Warning Event and a `kopf.PermanentError`.

| source | volume | `--model` |
| --- | --- | --- |
| `pvc://CLAIM[/PATH]` | the claim, read-only, at /models | /models/PATH |
| `hostpath:///ABS/PATH` | the node's folder or file, read-only, at /models/BASENAME | /models/BASENAME |
| `preset://NAME` | none (random weights; `--load-format dummy`) | NAME |
| `embedded` | none (SmolLM2, shipped in the image) | not passed |

Every pod also gets an emptyDir model cache (`$KVPILOT_CACHE`), where the embedded GGUF file is
converted once per pod start.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

MODELS_ROOT = "/models"
MODEL_VOLUME = "model"
SCHEMES = ("pvc://", "hostpath://", "preset://", "embedded")

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PRESET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SpecError(ValueError):
    """A spec that passes the CRD schema but cannot work; the message is shown to the user."""


@dataclass(frozen=True)
class ModelSource:
    model_arg: str | None  # what `kvpilot serve --model` gets; None serves the embedded model
    volume: dict[str, Any] | None = None  # the pod volume holding the weights, if any
    mount_path: str | None = None
    is_preset: bool = False


def resolve_model_source(source: str) -> ModelSource:
    if source == "embedded":
        return ModelSource(model_arg=None)
    scheme, sep, rest = source.partition("://")
    if not sep:
        raise SpecError(f"model.source {source!r} is not a URI; supported: {', '.join(SCHEMES)}")
    if scheme == "pvc":
        return _pvc(source, rest)
    if scheme == "hostpath":
        return _host_path(source, rest)
    if scheme == "preset":
        if not _PRESET.match(rest):
            raise SpecError(f"model.source {source!r}: a preset name is letters, digits, '.', '_', '-'")
        return ModelSource(model_arg=rest, is_preset=True)
    raise SpecError(
        f"model.source {source!r}: unsupported scheme {scheme + '://'!r} (supported: {', '.join(SCHEMES)});"
        " nothing is downloaded at run time: put the weights on a PVC or the node"
    )


def _pvc(source: str, rest: str) -> ModelSource:
    claim, _, sub_path = rest.partition("/")
    if not _DNS_SUBDOMAIN.match(claim) or len(claim) > 253:
        raise SpecError(f"model.source {source!r}: {claim!r} is not a valid PersistentVolumeClaim name")
    model_arg = _join_inside(source, MODELS_ROOT, sub_path)
    volume = {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return ModelSource(model_arg=model_arg, volume=volume, mount_path=MODELS_ROOT)


def _host_path(source: str, rest: str) -> ModelSource:
    if not rest.startswith("/"):
        raise SpecError(f"model.source {source!r}: write an absolute path as hostpath:///path")
    path = posixpath.normpath(rest)
    if path == "/" or ".." in rest.split("/"):
        raise SpecError(f"model.source {source!r}: the path must name a folder or file below /")
    mount_path = posixpath.join(MODELS_ROOT, posixpath.basename(path))
    volume = {"name": MODEL_VOLUME, "hostPath": {"path": path}}
    return ModelSource(model_arg=mount_path, volume=volume, mount_path=mount_path)


def _join_inside(source: str, root: str, sub_path: str) -> str:
    if ".." in sub_path.split("/"):
        raise SpecError(f"model.source {source!r}: the path may not contain '..'")
    joined = posixpath.normpath(posixpath.join(root, sub_path)) if sub_path else root
    return joined
