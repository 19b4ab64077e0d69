"""The live tunables' contract (runtime/tunables.py) is the one spelling of every tunable: the CRD's
enums, bounds and defaults, the operator's spec model and the runtime's flags and engine all agree
with it, and adding a tunable there without its other parts fails here."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

import msgspec
import pydantic
import pytest
from crd_admission import openapi_schema

from kvpilot.operator.manifests import Owner, engine_config
from kvpilot.operator.model_source import resolve_model_source
from kvpilot.operator.spec import AutotuneSpec, EngineSpec, InferenceServiceSpec
from kvpilot.runtime import tunables as contract
from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.cli import build_parser
from kvpilot.runtime.config import SCHEDULER_TUNABLES, SchedulerConfig
from kvpilot.runtime.tunables import (
    BLOCK_SIZE,
    BY_NAME,
    PREEMPTION_MODE,
    TUNABLES,
    LiveConfig,
    TunableArgs,
    check_changes,
)


def _not_default(t: Any) -> Any:
    value = next(c for c in t.choices if c != t.default) if t.choices else t.minimum + 6
    assert value != t.default
    return value


# a value of every tunable away from its default
NOT_DEFAULT = LiveConfig(**{t.name: _not_default(t) for t in TUNABLES})


def _spec() -> dict[str, Any]:
    return openapi_schema()["properties"]["spec"]["properties"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("tunable", TUNABLES, ids=lambda t: t.name)
def test_the_crds_engine_field_is_the_contracts(tunable: Any) -> None:
    field = _spec()["engine"]["properties"][tunable.camel]
    assert field["type"] == ("integer" if tunable.kind is int else "string")
    assert field.get("enum") == (list(tunable.choices) if tunable.choices else None)
    assert (field.get("minimum"), field.get("maximum")) == (tunable.minimum, tunable.maximum)
    assert field.get("default") == tunable.default


def test_the_crds_status_engine_shows_every_tunable_the_operator_writes_there() -> None:
    shown = openapi_schema()["properties"]["status"]["properties"]["engine"]["properties"]
    assert {t.camel for t in TUNABLES} <= set(shown)
    spec = InferenceServiceSpec.model_validate({"model": {"source": "embedded"}, "engine": NOT_DEFAULT.to_status()})
    written = engine_config(Owner("llama", "serving", "uid"), spec, resolve_model_source("embedded"))
    assert set(written) <= set(shown)
    assert {t.camel: written[t.camel] for t in TUNABLES} == NOT_DEFAULT.to_status()


def test_the_operators_engine_spec_holds_every_tunable_by_its_name_with_its_default() -> None:
    hints = typing.get_type_hints(TunableArgs)
    for t in TUNABLES:
        field = EngineSpec.model_fields[t.name]
        assert (field.alias, field.default) == (t.camel, t.default)
        nullable = type(None) in typing.get_args(hints[t.name])  # unset: the runtime resolves it
        try:
            assert EngineSpec.model_validate({t.camel: None}).model_dump()[t.name] is None and nullable
        except pydantic.ValidationError:
            assert not nullable
    assert LiveConfig.from_json(EngineSpec.model_validate(NOT_DEFAULT.to_status()).model_dump()) == NOT_DEFAULT


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
    assert all(f.default is dataclasses.MISSING or f.default == BY_NAME[f.name].default
               for f in dataclasses.fields(LiveConfig))
    config = LiveConfig(8, "swap", 128, 4096, "fair")
    assert LiveConfig.from_json({**config.to_json(), "num_blocks": 10}) == config  # the engine's extra keys
    assert LiveConfig.from_status(config.to_status()) == config
    status = config.to_status()
    assert list(status) == [t.camel for t in TUNABLES]
    assert (status["blockSize"], status["maxNumBatchedTokens"], status["schedulerPolicy"]) == (8, 4096, "fair")
    assert config.changes_to(LiveConfig(16, "swap", 128, 4096, "fair")) == {"block_size": 16}


@pytest.mark.parametrize(("changes", "message"), [
    ({"block_size": 12}, "block_size: must be one of 8, 16, 32, 64, not 12"),
    ({"max_num_seqs": 0}, "max_num_seqs: must be an integer from 1 to 65536, not 0"),
    ({"max_num_seqs": True}, "max_num_seqs: expected an integer from 1 to 65536, got True"),
    ({"preemption_mode": "drop"}, "preemption_mode: must be one of recompute, swap, not 'drop'"),
    ({"dtype": "float16"}, f"dtype: not a live tunable (tunables: {', '.join(t.name for t in TUNABLES)})"),
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
        assert action.help == tunable.help and tunable.help
    assert parser.parse_args(["--max-num-seqs", "65536"]).max_num_seqs == 65536
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "65537"])


def test_the_engine_arguments_of_every_tunable_are_the_contracts() -> None:
    """`TunableArgs` (EngineArgs' and, in the same types, EngineSpec's tunable fields) holds each
    tunable under its name, with its default and kind; None only where the engine resolves it."""
    hints = typing.get_type_hints(TunableArgs)
    fields = dataclasses.fields(TunableArgs)
    assert [f.name for f in fields] == [t.name for t in TUNABLES]
    for f, t in zip(fields, TUNABLES, strict=True):
        assert f.default == t.default and f.kw_only
        assert hints[f.name] == (t.kind if t.default is not None else t.kind | None)
    assert issubclass(EngineArgs, TunableArgs)


def test_every_tunable_reaches_the_engines_config_from_llm_keywords_and_flags() -> None:
    """EngineArgs (`LLM(...)`'s keywords, the flags' destination) carries each tunable, with the
    contract's default, into the config whose holders the engine reads."""
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert {t.name: fields[t.name] for t in TUNABLES} == {t.name: t.default for t in TUNABLES}
    args = EngineArgs(device="cpu", **NOT_DEFAULT.to_json())
    assert args.create_engine_config().tunables == NOT_DEFAULT


def test_the_engine_implements_every_tunable() -> None:
    # the block size re-cuts the KV cache (`LLMEngine.update_config`); each other tunable is a field
    # of the scheduler's config under its own name, which the scheduler reads every step
    assert {t.name for t in SCHEDULER_TUNABLES} | {BLOCK_SIZE.name} == set(BY_NAME)
    assert {t.name for t in SCHEDULER_TUNABLES} <= {f.name for f in dataclasses.fields(SchedulerConfig)}


def test_the_engine_cores_snapshot_carries_every_tunable() -> None:
    """The API process reports each pod's live config from the snapshot the core sends each step."""
    from kvpilot.runtime.engine.messages import EngineSnapshot

    encoded = msgspec.msgpack.encode(EngineSnapshot(num_blocks=4, live=NOT_DEFAULT))
    assert msgspec.msgpack.decode(encoded, type=EngineSnapshot).live == NOT_DEFAULT
    assert msgspec.msgpack.decode(encoded)[-1] == NOT_DEFAULT.to_json()  # keyed by the contract's names


def test_the_contracts_table_is_its_tunables() -> None:
    """The module docstring's table, which a reader takes for the contract, lists each tunable
    with its spellings, values and default."""
    rows = [[cell.strip(" `") for cell in line.strip("|").split("|")]
            for line in (contract.__doc__ or "").splitlines() if re.match(r"\| `", line)]
    assert [row[:3] for row in rows] == [[t.name, t.flag, t.camel] for t in TUNABLES]
    for row, t in zip(rows, TUNABLES, strict=True):
        values = (", ".join(map(str, t.choices)) if t.choices else f"{t.minimum:,} to {t.maximum:,}")
        assert row[3] == values
        assert row[4].startswith(str(t.default) if t.default is not None else "none")
