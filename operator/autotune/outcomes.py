"""The autotuner's memory: what each configuration of the tuned knobs (`tuning_spec.Knobs`: block
size, preemption mode and the two batch limits) measured while the service ran at its capacity, so
that the policy can keep what paid on this hardware and leave what did not. Capacities of two
batch limits are never merged: a larger batch may get through more tokens per second.

Terms. *Saturated*: a pod's window in which requests waited (mean queue depth at least one and at
least `queue_depth_low`) or sequences were preempted at `preemptions_per_s_high` or faster: the
engine ran flat out, so the tokens it got through per second are the configuration's capacity,
not the load's. *Throughput*: prompt plus generation tokens per second (a prompt counts once per
request, so the prefill a recompute preemption repeats is not counted as work). A configuration's
*estimate* is the duration-weighted mean throughput over every saturated window observed under it;
its standard error comes from the spread between windows, and two estimates differ only by more
than `canary.tolerance` and twice the noise of the difference, and only when they were measured
on a comparable request mix (`signals.request_mix`, the duration-weighted mean of the windows'
own, within the canary's comparable tolerance): long prompts get through more tokens per second
than chat on any configuration, so a configuration measured on documents does not beat one
measured on chat. It is *measured* once its windows
add up to the canary's window (`canary.window_s`: the time
a change is given to show what it is worth). Goodput cannot be compared this way: it follows the
offered load, which is what changed when the policy switched.

Windows are fed once each (the caller passes the span since its previous call), so a long stretch
under one configuration is not counted twice.

*Switch pauses*: a block-size change stops the engine while its KV cache is re-laid; the engine
reports that pause (`relayout.pause_ms` in the `POST /admin/config` answer), and the mean per
(from, to) is what the policy weighs a switch's expected gain against.

Estimates and pauses are per service. They are kept in the InferenceService's status
(`status.tuning.outcomes`: one entry per configuration, at most `MAX_OUTCOMES`, those with the
most saturated time; `status.tuning.switchPauses`: one per pair of block size and mode, so
bounded by those there are) and reloaded when the operator restarts, so a restarted operator does
not measure again what it already knew. A status entry without the batch limits (written before
they were kept) is dropped: it may merge several.

*Basis*: what the figures were measured under (the model, the image, the GPUs and placement, the
engine flags other than the tuned knobs: `pilot_spec.measurement_basis`), kept beside them in
`status.tuning.outcomesBasis`. Figures of another model or other hardware say nothing about this
one, so a basis that changes (a spec edit, or an operator started on a changed spec) drops every
estimate and pause (`rebase`). A status written without a basis takes the current one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from kvpilot.runtime.tunables import BLOCK_SIZE, PREEMPTION_MODE

from .signals import comparable_tolerance, mixes_differ, request_mix
from .tuning_spec import EngineTarget, Knobs, Thresholds
from .window import WindowSummary


@dataclass(frozen=True)
class Estimate:
    tokens_per_s: float  # per pod, mean over the saturated windows weighted by their length
    stderr: float  # of that mean, from the spread between windows; inf with one window
    seconds: float  # saturated time behind it (summed over windows, the shortest pod's span)
    num_windows: int
    mix: tuple[float, float] | None = None  # mean prompt and generated tokens a request; None: unknown

    def beats(self, other: Estimate, tolerance: float) -> bool:
        """Higher by more than `tolerance` (relative) and by more than twice the noise of the
        difference, on a comparable request mix: a gap inside either, or across two mixes,
        counts as no difference."""
        if self.mix is not None and other.mix is not None and \
                mixes_differ(self.mix, other.mix, comparable_tolerance(tolerance)):
            return False
        noise = 2 * math.hypot(self.stderr, other.stderr)
        return self.tokens_per_s - other.tokens_per_s > max(tolerance * other.tokens_per_s, noise)


Switch = tuple[EngineTarget, EngineTarget]  # (from, to): a pause follows the block size, not the batch limits
MAX_OUTCOMES = 64  # the CRD's bound on status.tuning.outcomes
_ABSENT = object()  # a status key left out of the patch (None would remove what is stored)


class Outcomes:
    def __init__(self, basis: Mapping[str, str] | None = None) -> None:
        self._sums: dict[Knobs, tuple[float, float, float, int]] = {}  # seconds, sum w*x, sum w*x^2, windows
        self._mixes: dict[Knobs, tuple[float, float, float]] = {}  # seconds, sum w*prompt, sum w*generated
        self._pauses: dict[Switch, tuple[float, int]] = {}  # summed pause seconds, switches
        self.basis: dict[str, str] = dict(basis or {})
        self._dropped = False  # a rebase dropped figures: status must lose them too, until new ones come

    def copy(self) -> Outcomes:
        """An independent copy: the tuner's step adds to a copy, never to the state it was given."""
        other = Outcomes(self.basis)
        other._sums, other._mixes, other._pauses = dict(self._sums), dict(self._mixes), dict(self._pauses)
        other._dropped = self._dropped
        return other

    def rebase(self, basis: Mapping[str, str]) -> list[str]:
        """Holds the figures to `basis` from now on. When they were measured under another one,
        they are dropped, and the return names each difference ("model: a -> b"); a memory without
        a basis (status from before bases were kept) takes this one and keeps its figures."""
        basis = dict(basis)
        if basis == self.basis:
            return []
        known, self.basis = self.basis, basis
        if not known or not (self._sums or self._pauses):
            return []
        self._sums.clear()
        self._mixes.clear()
        self._pauses.clear()
        self._dropped = True
        return [f"{key}: {known.get(key, '(unset)')} -> {basis.get(key, '(unset)')}"
                for key in sorted(known.keys() | basis.keys()) if known.get(key) != basis.get(key)]

    def record_pause(self, source: EngineTarget, target: EngineTarget, pause_s: float) -> None:
        """A switch from `source` to `target` stopped the engine for `pause_s` (the engine's own account)."""
        total, n = self._pauses.get((source, target), (0.0, 0))
        self._pauses[(source, target)] = (total + max(0.0, pause_s), n + 1)

    def pauses(self) -> dict[Switch, float]:
        """The mean pause of each switch seen, in seconds."""
        return {pair: total / n for pair, (total, n) in self._pauses.items()}

    def observe(self, summaries: Mapping[str, WindowSummary], thresholds: Thresholds, *,
                last_change: float | None = None) -> Knobs | None:
        """Adds the span the pods' `summaries` cover if they all ran one configuration throughout
        and were saturated; returns that configuration, or None when the span was not counted.
        A span that begins before `last_change` (the latest switch) holds work of two configurations
        and is not counted."""
        if not summaries or any(last_change is not None and s.start < last_change for s in summaries.values()):
            return None
        settings = {s.settings.knobs for s in summaries.values()}
        if len(settings) != 1 or any(s.settings_changed or s.num_restarts for s in summaries.values()):
            return None
        windows = list(summaries.values())
        if not saturated(windows, thresholds):
            return None
        key = settings.pop()
        seconds = min(s.duration_s for s in windows)
        if seconds <= 0:
            return None
        rate = fmean((s.prompt_tokens_per_s + s.generation_tokens_per_s) for s in windows)
        w, sx, sxx, n = self._sums.get(key, (0.0, 0.0, 0.0, 0))
        self._sums[key] = (w + seconds, sx + seconds * rate, sxx + seconds * rate * rate, n + 1)
        if (mix := request_mix(windows)) is not None:
            self._add_mix(key, seconds, mix)
        return key

    def _add_mix(self, key: Knobs, seconds: float, mix: tuple[float, float]) -> None:
        w, sp, sg = self._mixes.get(key, (0.0, 0.0, 0.0))
        self._mixes[key] = (w + seconds, sp + seconds * mix[0], sg + seconds * mix[1])

    def estimate(self, config: Knobs) -> Estimate | None:
        """Whatever has been observed, measured or not."""
        if config not in self._sums:
            return None
        w, sx, sxx, n = self._sums[config]
        mean = sx / w
        variance = max(0.0, sxx / w - mean * mean)
        stderr = math.sqrt(variance / (n - 1)) if n > 1 else math.inf
        return Estimate(mean, stderr, w, n, self._mix(config))

    def _mix(self, config: Knobs) -> tuple[float, float] | None:
        if config not in self._mixes:
            return None
        w, sp, sg = self._mixes[config]
        return sp / w, sg / w

    def measured(self, min_seconds: float) -> dict[Knobs, Estimate]:
        """The estimates backed by at least `min_seconds` of saturated data: what the policy uses."""
        out = {}
        for config in self._sums:
            e = self.estimate(config)
            if e is not None and e.seconds >= min_seconds:
                out[config] = e
        return out

    def to_status(self) -> dict[str, Any]:
        """`status.tuning.outcomes`, `status.tuning.switchPauses` and `status.tuning.outcomesBasis`
        (each left out while empty; None after `rebase` dropped them, so that the status patch
        removes them): the sums behind each estimate as mean, spread and weight, so `from_status`
        restores them."""
        gone = None if self._dropped else _ABSENT
        out: dict[str, Any] = {"outcomes": gone, "switchPauses": gone}
        rows = []
        kept = sorted(self._sums.items(), key=lambda kv: -kv[1][0])[:MAX_OUTCOMES]
        for config, (w, sx, sxx, n) in sorted(kept, key=lambda kv: _order(kv[0])):
            mean = sx / w
            row = {**config.to_status(), "tokensPerSecond": round(mean, 3),
                   "spread": round(math.sqrt(max(0.0, sxx / w - mean * mean)), 3), "seconds": round(w, 3),
                   "windows": n}
            if (mix := self._mix(config)) is not None:
                row |= {"promptTokensPerRequest": round(mix[0], 3), "generatedTokensPerRequest": round(mix[1], 3)}
            rows.append(row)
        if rows:
            out["outcomes"] = rows
        if self._pauses:
            out["switchPauses"] = [{"from": _target(a), "to": _target(b), "pauseMs": round(total / n * 1e3, 3),
                                    "switches": n}
                                   for (a, b), (total, n) in sorted(self._pauses.items(),
                                                                    key=lambda kv: (_order(kv[0][0]), _order(kv[0][1])))]
        if self.basis:
            out["outcomesBasis"] = dict(sorted(self.basis.items()))
        return {k: v for k, v in out.items() if v is not _ABSENT}

    @classmethod
    def from_status(cls, tuning: Mapping[str, Any]) -> Outcomes:
        """What `to_status` wrote (`status.tuning`); an entry it cannot read is dropped, not fatal."""
        basis = tuning.get("outcomesBasis")
        outcomes = cls({str(k): str(v) for k, v in basis.items()} if isinstance(basis, Mapping) else None)
        for row in tuning.get("outcomes") or []:
            try:
                config, w, n = Knobs.from_status(row), float(row["seconds"]), int(row["windows"])
                mean, spread = float(row["tokensPerSecond"]), float(row["spread"])
            except (KeyError, TypeError, ValueError):
                continue
            if w > 0 and n > 0:
                outcomes._sums[config] = (w, w * mean, w * (spread * spread + mean * mean), n)
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    outcomes._add_mix(config, w, (float(row["promptTokensPerRequest"]),
                                                  float(row["generatedTokensPerRequest"])))
        for row in tuning.get("switchPauses") or []:
            try:
                pair, n = (_from_target(row["from"]), _from_target(row["to"])), int(row["switches"])
                pause_s = float(row["pauseMs"]) / 1e3
            except (KeyError, TypeError, ValueError):
                continue
            if n > 0:
                outcomes._pauses[pair] = (pause_s * n, n)
        return outcomes


def _target(config: EngineTarget) -> dict[str, Any]:
    return {BLOCK_SIZE.camel: config.block_size, PREEMPTION_MODE.camel: config.preemption_mode}


def _from_target(row: Mapping[str, Any]) -> EngineTarget:
    return EngineTarget(int(row[BLOCK_SIZE.camel]), str(row[PREEMPTION_MODE.camel]))


def _order(config: Knobs | EngineTarget) -> tuple[Any, ...]:
    return dataclasses.astuple(config)


def saturated(windows: list[WindowSummary], t: Thresholds) -> bool:
    queue = fmean(s.num_waiting_seqs for s in windows)
    preemptions = fmean(s.preemptions_per_s for s in windows)
    return (queue >= max(1.0, t.queue_depth_low)) or preemptions >= t.preemptions_per_s_high
