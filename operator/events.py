"""Kubernetes Events about an InferenceService, from component `kvpilot` (what `kubectl describe`
shows in its From column): what the pilot's steps ask to post (`Event`) and a pure builder of
the object; the controller and the pilot post them."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Literal

from .objects import Manifest

COMPONENT = "kvpilot"
MAX_MESSAGE = 1024  # the API server refuses longer ones



@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def build_event(obj: Manifest, type_: str, reason: str, message: str, instance: str, now: str) -> Manifest:
    meta = obj["metadata"]
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 1] + "…"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        # Unique as kubectl's are: the object's name and a random suffix.
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid", ""),
                           "resourceVersion": meta.get("resourceVersion", "")},
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
        "action": reason,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
