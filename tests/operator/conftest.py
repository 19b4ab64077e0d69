"""Fixtures over the offline stand-in for the API server (tests/support/crd_admission.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from crd_admission import admit, inference_service, load_crd, openapi_schema


@pytest.fixture
def crd() -> dict[str, Any]:
    return load_crd()


@pytest.fixture
def schema() -> dict[str, Any]:
    return openapi_schema()


@pytest.fixture
def admission() -> Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]:
    return admit


@pytest.fixture
def make_isvc() -> Callable[..., dict[str, Any]]:
    return inference_service
