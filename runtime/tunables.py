"""The live tunables: the one place that names them, spells them on every wire, bounds them and
checks a value. The runtime (its flags, `--tuned-config`, `POST /admin/config`, the engine's
`update_config`) and the operator (the CRD's spec, status.tuning, the tuned ConfigMap, the
autotuner) both read this table. Plain Python only: the operator imports it without torch.

| name (JSON, `LLM(...)`) | flag | CRD (camelCase) | values | default |
| --- | --- | --- | --- | --- |
| `block_size` | `--block-size` | `blockSize` | 8, 16, 32, 64 | 16 |
| `preemption_mode` | `--preemption-mode` | `preemptionMode` | recompute, swap | recompute |
| `max_num_seqs` | `--max-num-seqs` | `maxNumSeqs` | 1 to 65,536 | 256 |
| `max_num_batched_tokens` | `--max-num-batched-tokens` | `maxNumBatchedTokens` | 1 to 1,048,576 | none: 2048, or max_model_len without chunked prefill |
| `scheduler_policy` | `--scheduler-policy` | `schedulerPolicy` | fcfs, fair, priority | fcfs |

From `TUNABLES` come the flags of `kvpilot serve` and `kvpilot generate` (spelling, rule, default,
help), the names `check_changes` accepts, the engine core's snapshot (a `LiveConfig`) and so the
labels of `kvpilot_live_config_info`, the operator's `EngineSpec` fields, its flags for
the pods and status.engine, and the CRD's properties for them (`make crds` writes them into crds/
and the chart's copy; a test fails while they differ).
Adding a tunable takes two edits (tests/runtime/test_tunables.py fails until both are done, and
tests/runtime/test_new_tunable.py makes both to a copy of the sources to show the rest follows):
1. here: its `Tunable` in `TUNABLES`, its `LiveConfig` and `TunableArgs` fields, its row in the
   table above; then `make crds`;
2. its holder in the engine: a `SchedulerConfig` field of the same name listed in
   `SCHEDULER_TUNABLES` (config.py), which `EngineArgs` fills and `LLMEngine.update_config`
   replaces, or an engine-specific path in `LLMEngine.update_config` (as the block size's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tunable:
    name: str  # the JSON name of GET/POST /admin/config and --tuned-config, and the LLM(...) keyword
    camel: str  # the CRD's (spec.engine, status.tuning)
    kind: type  # int or str
    choices: tuple[Any, ...] | None = None  # the value set, or
    minimum: int | None = None  # the bounds of an integer
    maximum: int | None = None
    default: Any = None  # None: resolved at start (max_num_batched_tokens: from the context length)
    help: str = ""  # the flag's (`kvpilot serve --help`), also the CRD's spec.engine description
    title: str = ""  # a few words for the CRD's status descriptions

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """`value` when it is valid; otherwise ValueError naming the tunable and the rule."""
        if type(value) is not self.kind:  # bool is an int subclass: never a valid integer here
            raise ValueError(f"{self.name}: expected {self.rule}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name}: must be {self.rule}, not {value!r}")
        if isinstance(value, int) and ((self.minimum is not None and value < self.minimum)
                                       or (self.maximum is not None and value > self.maximum)):
            raise ValueError(f"{self.name}: must be {self.rule}, not {value!r}")
        return value

    @property
    def rule(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        kind = "an integer" if self.kind is int else "a string"
        if self.minimum is not None and self.maximum is not None:
            return f"{kind} from {self.minimum} to {self.maximum}"
        return kind if self.minimum is None else f"{kind} >= {self.minimum}"


BLOCK_SIZE = Tunable("block_size", "blockSize", int, choices=(8, 16, 32, 64), default=16,
                     help="token slots in one KV cache block; a change re-cuts the cache in place, keeping "
                          "the KV of running and swapped sequences",
                     title="KV cache block size")
PREEMPTION_MODE = Tunable("preemption_mode", "preemptionMode", str, choices=("recompute", "swap"),
                          default="recompute",
                          help="recompute: drop a preempted sequence's KV and prefill it again; swap: copy it to "
                               "the --swap-space host memory and back (recompute when that is full)",
                          title="Preemption mode")
SCHEDULER_POLICY = Tunable("scheduler_policy", "schedulerPolicy", str, choices=("fcfs", "fair", "priority"),
                           default="fcfs",
                           help="fcfs: arrival order; priority: the request's `priority` (lower first) with aging "
                                "(--priority-aging), preemption takes the least important; fair: per-tenant fair "
                                "share of served tokens (Virtual Token Counter; the tenant is the API key's from "
                                "--api-key-file, else the request's `user`)",
                           title="Scheduler policy")
MAX_NUM_SEQS = Tunable("max_num_seqs", "maxNumSeqs", int, minimum=1, maximum=65536, default=256,
                       help="sequences in one step's batch", title="Sequences in one batch")
MAX_NUM_BATCHED_TOKENS = Tunable("max_num_batched_tokens", "maxNumBatchedTokens", int, minimum=1, maximum=1 << 20,
                                 help="tokens in one step (default: 2048, or max_model_len without chunked prefill)",
                                 title="Tokens in one step")

TUNABLES: tuple[Tunable, ...] = (BLOCK_SIZE, PREEMPTION_MODE, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS,
                                 SCHEDULER_POLICY)
BY_NAME: Mapping[str, Tunable] = {t.name: t for t in TUNABLES}
BLOCK_SIZES: tuple[int, ...] = BLOCK_SIZE.choices  # type: ignore[assignment]
PREEMPTION_MODES: tuple[str, ...] = PREEMPTION_MODE.choices  # type: ignore[assignment]
SCHEDULER_POLICIES: tuple[str, ...] = SCHEDULER_POLICY.choices  # type: ignore[assignment]


def check_changes(changes: Mapping[str, Any]) -> dict[str, Any]:
    """A set of tunables by name (a `POST /admin/config` body, a `--tuned-config` file), each
    checked; ValueError names the first unknown name or bad value."""
    unknown = sorted(set(changes) - set(BY_NAME))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a live tunable (tunables: {', '.join(BY_NAME)})")
    return {name: BY_NAME[name].check(value) for name, value in changes.items()}


@dataclass(frozen=True)
class LiveConfig:
    """Every live tunable's value: what `GET /admin/config` reports and the operator tunes."""

    block_size: int
    preemption_mode: str
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduler_policy: str = SCHEDULER_POLICY.default

    def __post_init__(self) -> None:
        for t in TUNABLES:  # not check_changes(asdict(self)): the core builds one for every step's snapshot
            t.check(getattr(self, t.name))

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> LiveConfig:
        """From the JSON names (an engine's `GET /admin/config` may carry more: they are left out)."""
        try:
            return cls(**{t.name: values[t.name] for t in TUNABLES})
        except KeyError as e:
            raise ValueError(f"{e.args[0]}: missing from {dict(values)}") from None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_status(self) -> dict[str, Any]:
        """The CRD's spelling (status.tuning.config)."""
        return {t.camel: getattr(self, t.name) for t in TUNABLES}

    @classmethod
    def from_status(cls, values: Mapping[str, Any] | None) -> LiveConfig | None:
        """What `to_status` wrote; None for a missing or unreadable one."""
        try:
            return cls(**{t.name: (values or {})[t.camel] for t in TUNABLES})
        except (KeyError, TypeError, ValueError):
            return None

    def changes_to(self, target: LiveConfig) -> dict[str, Any]:
        """The body of the `POST /admin/config` that turns this config into `target`."""
        mine = self.to_json()
        return {name: value for name, value in target.to_json().items() if mine[name] != value}


@dataclass(kw_only=True)
class TunableArgs:
    """The live tunables' start values as engine arguments: `EngineArgs` (`LLM(...)`'s keywords,
    the flags' destination) inherits these fields, and the operator's `EngineSpec` has the same
    (spec.engine). None: the engine resolves it at start."""

    block_size: int = BLOCK_SIZE.default
    preemption_mode: str = PREEMPTION_MODE.default
    max_num_seqs: int = MAX_NUM_SEQS.default
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len without chunking
    scheduler_policy: str = SCHEDULER_POLICY.default
