"""Engine defaults have one source of truth, the runtime's `kvpilot serve` flags: the CRD's default
and the operator's spec model agree with it for every engine field, and the command line the
operator builds parses, with the runtime's own parser, into exactly what the spec says.

(The tests may import the runtime; the operator package never does.)"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, get_args

import pytest
from crd_admission import openapi_schema
from pydantic.alias_generators import to_camel

from kvpilot.operator.engine_args import serve_args
from kvpilot.operator.model_source import resolve_model_source
from kvpilot.operator.spec import EngineSpec, InferenceServiceSpec, ModelSpec
from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.cli import build_parser
from kvpilot.runtime.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS

ENGINE_FIELDS = sorted(EngineSpec.model_fields)


def _serve(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _crd_engine() -> dict[str, Any]:
    return openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]  # type: ignore[no-any-return]


def test_every_crd_engine_field_is_in_the_operators_model() -> None:
    assert sorted(_crd_engine()) == sorted(to_camel(name) for name in ENGINE_FIELDS)


@pytest.mark.parametrize("field", ENGINE_FIELDS)
def test_crd_operator_and_runtime_defaults_agree(field: str) -> None:
    runtime = vars(_serve([]))
    assert field in runtime, f"kvpilot serve has no flag for engine.{to_camel(field)}"
    crd = _crd_engine()[to_camel(field)].get("default")
    operator = EngineSpec.model_fields[field].default
    assert (crd, operator) == (runtime[field], runtime[field])
    engine_args = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    if field in engine_args:  # the flags take their defaults from EngineArgs; so must LLM(...)
        assert engine_args[field] == runtime[field]


ALL_ON = {"enableChunkedPrefill": True, "enablePrefixCaching": True, "enforceEager": True,
          "disableLogStats": True, "blockSize": 32, "swapSpace": 8, "gpuMemoryUtilization": 0.85,
          "numGpuBlocksOverride": 1000, "kvCacheDtype": "fp8", "maxNumSeqs": 128, "maxNumBatchedTokens": 8192, "maxModelLen": 4096,
          "preemptionMode": "swap", "schedulerPolicy": "priority", "priorityAging": 30,
          "fairPromptWeight": 0.5, "fairOutputWeight": 4, "maxQueueLen": 100, "metricInterval": 2.5,
          "device": "cuda", "seed": 7}
ALL_OFF = {"enableChunkedPrefill": False, "enablePrefixCaching": False, "enforceEager": False,
           "disableLogStats": False, "device": "cpu"}


@pytest.mark.parametrize("engine", [{}, ALL_ON, ALL_OFF], ids=["defaults", "all-on", "all-off"])
def test_the_pod_runs_exactly_the_spec(engine: dict[str, Any]) -> None:
    spec = InferenceServiceSpec.model_validate({"model": {"source": "embedded"}, "engine": engine})
    parsed = vars(_serve(serve_args(spec, resolve_model_source("embedded"), "llama")))
    wanted = spec.engine.model_dump()
    assert {field: parsed[field] for field in ENGINE_FIELDS} == wanted


def test_crd_and_operator_take_every_quantization_the_runtime_serves() -> None:
    crd = openapi_schema()["properties"]["spec"]["properties"]["model"]["properties"]["quantization"]["enum"]
    literal, _none = get_args(ModelSpec.model_fields["quantization"].annotation)
    assert crd == list(get_args(literal)) == ["auto", *QUANTIZATION_METHODS]


def test_crd_and_operator_take_every_kv_cache_dtype_the_runtime_has() -> None:
    crd = _crd_engine()["kvCacheDtype"]["enum"]
    assert crd == list(get_args(EngineSpec.model_fields["kv_cache_dtype"].annotation)) == list(KV_CACHE_DTYPES)
