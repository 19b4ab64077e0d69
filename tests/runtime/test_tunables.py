"""The live tunables' contract (runtime/tunables.py) is the one spelling of every tunable: the CRD's
enums, bounds and defaults, the operator's spec model and the runtime's flags and engine all agree
with it, and adding a tunable there without its other parts fails here."""

from __future__ import annotations

import dataclasses
from typing import Any

import pydantic
import pytest
from crd_admission import openapi_schema

from kvpilot.operator.spec import AutotuneSpec, EngineSpec
from kvpilot.runtime.cli import build_parser
from kvpilot.runtime.tunables import (
    BLOCK_SIZE,
    BY_NAME,
    PREEMPTION_MODE,
    TUNABLES,
    LiveConfig,
    check_changes,
)


def _spec() -> dict[str, Any]:
    return openapi_schema()["properties"]["spec"]["properties"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("tunable", TUNABLES, ids=lambda t: t.name)
def test_the_crds_engine_field_is_the_contracts(tunable: Any) -> None:
    field = _spec()["engine"]["properties"][tunable.camel]
    assert field["type"] == ("integer" if tunable.kind is int else "string")
    assert field.get("enum") == (list(tunable.choices) if tunable.choices else None)
    assert (field.get("minimum"), field.get("maximum")) == (tunable.minimum, tunable.maximum)
    assert field.get("default") == tunable.default


def test_the_crds_autotune_choices_and_status_are_the_contracts() -> None:
    autotune = _spec()["autotune"]["properties"]
    assert autotune["allowedBlockSizes"]["items"]["enum"] == list(BLOCK_SIZE.choices or ())
    assert autotune["allowedPreemptionModes"]["items"]["enum"] == list(PREEMPTION_MODE.choices or ())
    for target in ("pressure", "calm"):
        assert autotune[target]["properties"][BLOCK_SIZE.camel]["enum"] == list(BLOCK_SIZE.choices or ())
        assert autotune[target]["properties"][PREEMPTION_MODE.camel]["enum"] == list(PREEMPTION_MODE.choices or ())
    status = openapi_schema()["properties"]["status"]["properties"]["tuning"]["properties"]
    assert sorted(status["config"]["properties"]) == sorted(t.camel for t in TUNABLES)
    assert set(AutotuneSpec().allowed_block_sizes) <= set(BLOCK_SIZE.choices or ())


def test_live_config_holds_every_tunable_and_speaks_each_wire() -> None:
    assert [f.name for f in dataclasses.fields(LiveConfig)] == [t.name for t in TUNABLES]
    config = LiveConfig(8, "swap", 128, 4096, "fair")
    assert LiveConfig.from_json({**config.to_json(), "num_blocks": 10}) == config  # the engine's extra keys
    assert LiveConfig.from_status(config.to_status()) == config
    assert config.to_status() == {"blockSize": 8, "preemptionMode": "swap", "maxNumSeqs": 128,
                                  "maxNumBatchedTokens": 4096, "schedulerPolicy": "fair"}
    assert config.changes_to(LiveConfig(16, "swap", 128, 4096, "fair")) == {"block_size": 16}


@pytest.mark.parametrize(("changes", "message"), [
    ({"block_size": 12}, "block_size: must be one of 8, 16, 32, 64, not 12"),
    ({"max_num_seqs": 0}, "max_num_seqs: must be an integer from 1 to 65536, not 0"),
    ({"max_num_seqs": True}, "max_num_seqs: expected an integer from 1 to 65536, got True"),
    ({"preemption_mode": "drop"}, "preemption_mode: must be one of recompute, swap, not 'drop'"),
    ({"dtype": "float16"}, "dtype: not a live tunable (tunables: block_size, preemption_mode, max_num_seqs, "
                           "max_num_batched_tokens, scheduler_policy)"),
])
def test_one_check_for_every_wire(changes: dict[str, Any], message: str) -> None:
    """The same rule and words for POST /admin/config, --tuned-config, LiveConfig and the spec."""
    with pytest.raises(ValueError) as caught:
        check_changes(changes)
    assert str(caught.value) == message
    name, value = next(iter(changes.items()))
    if "must be" in message:  # (the API server's schema refuses a wrong type before the operator sees it)
        with pytest.raises(pydantic.ValidationError) as refused:
            EngineSpec.model_validate({BY_NAME[name].camel: value})
        assert message in str(refused.value)


def test_every_tunable_is_a_serve_flag_with_the_contracts_default_and_values() -> None:
    serve = next(a for a in build_parser()._actions if a.dest == "command")  # noqa: SLF001
    parser = serve.choices["serve"]  # type: ignore[index]
    flags = {a.dest: a for a in parser._actions}  # noqa: SLF001
    for tunable in TUNABLES:
        action = flags[tunable.name]
        assert tunable.flag in action.option_strings
        assert action.default == tunable.default
        assert list(action.choices or ()) == list(tunable.choices or ())
    assert parser.parse_args(["--max-num-seqs", "65536"]).max_num_seqs == 65536
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "65537"])


def test_the_engine_implements_every_tunable() -> None:
    from kvpilot.runtime.engine.engine import SCHEDULER_FIELDS

    # the block size re-cuts the KV cache; each other tunable is a field of the scheduler's config
    assert set(SCHEDULER_FIELDS) | {"block_size"} == set(BY_NAME)
    from kvpilot.runtime.config import SchedulerConfig

    assert set(SCHEDULER_FIELDS.values()) <= {f.name for f in dataclasses.fields(SchedulerConfig)}
