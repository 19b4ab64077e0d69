"""`Manifest`: a Kubernetes object, or a part of one, as the API's JSON (dicts, lists and
scalars): what the builders return, the client layer sends and receives, and status holds."""

from __future__ import annotations

from typing import Any

Manifest = dict[str, Any]
