"""The tuning policy: a pure function from the pods' windows, the config in force and the spec to
a decision, with a reason that names the metric values behind it.

Terms. *Pressure*: requests queue or sequences are preempted faster than the engine can serve
them; the policy then moves to `spec.pressure` (default block size 8, swap): smaller blocks waste
less of the last block of each sequence, so more sequences fit, and swap keeps a preempted
sequence's KV instead of computing it again. *Calm*: the rest of the time, `spec.calm` (default
16, recompute). The service is in calm exactly when its config is the calm target (or the
configuration measurements put in its place, below); anything else leaves only once every signal
is below its low level (hysteresis), and enters pressure once one is above its high level.

Rules, in the order a reason lists them:
* regime: queue depth or preemption rate above its high level, or P99 TTFT over its target while
  requests queue, enters pressure; all below their low levels returns to calm;
* measured outcomes (`outcomes.py`: each configuration's throughput while saturated, once it has
  a canary window of data; those measured at the batch limits in force, since a capacity at other
  limits says nothing of these) overrule the two targets, which are only priors. Under pressure: the
  pressure target is tried while it is unmeasured; once measured, if it got through fewer tokens
  per second than the best measured configuration (by more than `canary.tolerance` and the
  noise between windows), the untried
  one-knob mixes of the two are tried, the one that keeps the better block size first (a mode
  change moves no KV); with nothing left to try, the service goes to the best measured
  configuration, and only if it beats the one in force by more than the tolerance: a knob whose
  values measured within it does not matter here, and is left where it is. In calm: the calm
  target, unless it measured worse than the best configuration, which then stays (calm is bound
  by demand, not by the engine, and the next burst finds the best configuration in place);
* switch cost: a block-size change pauses the engine while it re-lays its KV cache; once such a
  switch has been seen (`Outcomes.pauses`: the engine's `relayout.pause_ms`, per from -> to) and
  both configurations are measured, the switch is made only if its expected gain over the minimum
  dwell (the measured tokens/s difference x `min_dwell_s`, the least time a configuration is given
  before the next decision) is at least the tokens the pause loses (the config in force's tokens/s
  x the pause). A switch to an unmeasured configuration is a trial, with no gain to weigh;
* preemption mode: swap only where allowed, with swap space, and (when
  `swap_min_context_tokens` is set) for contexts long enough that copying beats prefilling again;
* max_num_seqs (when the spec gives a range): doubled when it, not memory, binds (a queue, KV
  usage low, running at the limit; then the queue alone does not mean pressure, since smaller
  blocks would not admit one more sequence), halved when memory thrashes (preemptions high, KV
  usage high);
* max_num_batched_tokens (with a range and an SLO): halved when P99 ITL misses its target and TTFT
  does not (prefill chunks stall decodes less), doubled in the opposite case;
* batch limits the two rules above ask for that were measured at capacity (at the block size and
  mode chosen) and got through no more tokens per second than those in force (within
  `canary.tolerance` and the noise) are not tried again: those in force stay.
Cooldown and dwell gate everything: no change within `cooldown_s` of the last one, and none on
less than `min_dwell_s` of data gathered under the config in force.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvpilot.runtime.tunables import LiveConfig

from .engine_limits import EngineLimits
from .outcomes import Estimate, Switch
from .signals import Signals, aggregate
from .tuning_spec import EngineTarget, Knobs, Thresholds, TuningSpec
from .window import WindowSummary

# A limit that binds is hit at every step, but a scrape lands between sequences finishing and
# new ones being admitted, so the mean over scrapes sits a little under it.
_AT_LIMIT = 0.9


@dataclass(frozen=True)
class Decision:
    current: LiveConfig
    target: LiveConfig | None  # None: keep the config in force
    reason: str
    signals: Signals | None  # None when the decision was taken without looking at metrics

    @property
    def changes(self) -> dict[str, int | str]:
        """The `POST /admin/config` body; empty when nothing changes."""
        return self.current.changes_to(self.target) if self.target is not None else {}


def decide(summaries: Mapping[str, WindowSummary], current: LiveConfig, spec: TuningSpec,
           limits: EngineLimits, *, now: float, last_change: float | None,
           measured: Mapping[Knobs, Estimate] | None = None,
           pauses: Mapping[Switch, float] | None = None) -> Decision:
    """`summaries`: each Ready pod's window over (now - spec.min_dwell_s, now], by pod name.
    `last_change`: when the config in force was applied (or rolled back to); None if never.
    `measured`: `Outcomes.measured()`, the configurations' throughput at capacity; none: the
    targets alone decide. `pauses`: `Outcomes.pauses()`, the seconds each switch seen stopped the
    engine; none: switches are free."""
    if last_change is not None and now - last_change < spec.cooldown_s:
        return Decision(current, None, f"cooldown: {now - last_change:.0f} s since the last change, "
                                       f"{spec.cooldown_s:g} s required", None)
    usable, left_out = _usable(summaries, current, spec)
    if not usable:
        why = "; ".join(left_out) if left_out else "no pod has been scraped"
        return Decision(current, None, f"not enough data: {why}", None)
    signals = aggregate(usable, spec.slo)
    in_force = Knobs.of(current)
    known = {c.engine: e for c, e in (measured or {}).items()
             if c == in_force.with_engine(c.engine) and _allowed(c.engine, spec, limits)}
    engine, why_engine = _engine_target(signals, current, spec, limits, known)
    engine, why_cost = _switch_cost(EngineTarget(current.block_size, current.preemption_mode), engine, known,
                                    pauses or {}, spec.min_dwell_s)
    why_engine = "; ".join(r for r in (why_engine, why_cost) if r)
    seqs, why_seqs = _max_num_seqs(signals, current, spec)
    tokens, why_tokens = _max_num_batched_tokens(signals, current, spec, limits)
    seqs, tokens, why_measured = _measured_limits(in_force.with_engine(engine), seqs, tokens, measured or {},
                                                  spec.canary.tolerance)
    why_tokens = "; ".join(r for r in (why_tokens, why_measured) if r)
    target = dataclasses.replace(current, block_size=engine.block_size, preemption_mode=engine.preemption_mode,
                                 max_num_seqs=seqs, max_num_batched_tokens=tokens)
    reason = "; ".join([r for r in (why_engine, why_seqs, why_tokens) if r] + left_out)
    if target == current:
        return Decision(current, None, f"hold: {reason}", signals)
    return Decision(current, target, reason, signals)


def _usable(summaries: Mapping[str, WindowSummary], current: LiveConfig,
            spec: TuningSpec) -> tuple[list[WindowSummary], list[str]]:
    """The windows that show the config in force for at least the dwell, and why others do not."""
    usable, left_out = [], []
    for pod, s in sorted(summaries.items()):
        if (differences := s.settings.knobs.differences(Knobs.of(current))):
            left_out.append(f"pod {pod} reports {differences}: not the config in force")
        elif s.settings_changed:
            left_out.append(f"pod {pod} changed settings within its window")
        elif s.duration_s < spec.min_dwell_s:
            left_out.append(f"pod {pod} has {s.duration_s:.0f} s of data, {spec.min_dwell_s:g} s needed")
        else:
            usable.append(s)
    return usable, left_out


def _engine_target(sig: Signals, current: LiveConfig, spec: TuningSpec, limits: EngineLimits,
                   known: Mapping[EngineTarget, Estimate]) -> tuple[EngineTarget, str]:
    t = spec.thresholds
    held = EngineTarget(current.block_size, current.preemption_mode)
    calm, calm_note = _resolve(spec.calm, sig, spec, limits, current)
    calm, calm_note = _calm_choice(calm, calm_note, known, spec.canary.tolerance)
    triggers = _pressure_triggers(sig, current, spec)
    below = sig.queue_depth < t.queue_depth_low and sig.preemptions_per_s < t.preemptions_per_s_low
    band = (f"queue depth {sig.queue_depth:.1f} and preemptions {sig.preemptions_per_s:.2f}/s are not all below "
            f"their low levels ({t.queue_depth_low:g}, {t.preemptions_per_s_low:g}/s)")
    if not triggers and held != calm and not below and not known:
        return held, f"{band}: block_size {held.block_size}, {held.preemption_mode} stays"
    if triggers or (held != calm and not below):
        pressure, pressure_note = _resolve(spec.pressure, sig, spec, limits, current)
        target, why = _under_pressure(held, pressure, pressure_note, known, spec.canary.tolerance)
        if triggers:
            return target, f"{' and '.join(triggers)}: pressure -> {why}"
        return target, f"{band}: pressure -> {why}"
    if held == calm:
        return calm, (f"calm: queue depth {sig.queue_depth:.1f} <= {t.queue_depth_high:g}, "
                      f"preemptions {sig.preemptions_per_s:.2f}/s <= {t.preemptions_per_s_high:g}/s")
    return calm, (f"queue depth {sig.queue_depth:.1f} < {t.queue_depth_low:g} and preemptions "
                  f"{sig.preemptions_per_s:.2f}/s < {t.preemptions_per_s_low:g}/s: calm -> "
                  f"{_describe(calm, calm_note)}")


def _under_pressure(held: EngineTarget, pressure: EngineTarget, note: str, known: Mapping[EngineTarget, Estimate],
                    tolerance: float) -> tuple[EngineTarget, str]:
    """Where pressure takes the service: see the module docstring's "measured outcomes"."""
    if pressure not in known:
        why = "unmeasured, tried" if known else ""
        return pressure, _describe(pressure, "; ".join(n for n in (note, why) if n))
    best = max(known, key=lambda c: (known[c].tokens_per_s, c == held))
    if known[best].beats(known[pressure], tolerance):
        mixes = [EngineTarget(best.block_size, pressure.preemption_mode),
                 EngineTarget(pressure.block_size, best.preemption_mode)]
        untried = [m for m in mixes if m not in known and m not in (best, pressure)]
        if untried:
            return untried[0], (f"{_describe(pressure, note)} measured {_rate(known[pressure])} against "
                                f"{_short(best)} {_rate(known[best])}: trying {_short(untried[0])}")
    return _best_measured(held, best, known, tolerance)


def _best_measured(held: EngineTarget, best: EngineTarget, known: Mapping[EngineTarget, Estimate],
                   tolerance: float) -> tuple[EngineTarget, str]:
    if held == best:
        return held, f"{_short(held)}, the best measured ({_rate(known[held])})"
    mine = known.get(held)
    if mine is not None and not known[best].beats(mine, tolerance):
        return held, (f"{_short(held)} stays: {_short(best)} measured {_rate(known[best])} against its "
                      f"{_rate(mine)}, within {tolerance:.0%} or the noise")
    against = f" against {_rate(mine)}" if mine is not None else ""
    return best, f"{_short(best)}, the best measured ({_rate(known[best])}{against})"


def _calm_choice(calm: EngineTarget, note: str, known: Mapping[EngineTarget, Estimate],
                 tolerance: float) -> tuple[EngineTarget, str]:
    if calm not in known or not known:
        return calm, note
    best = max(known, key=lambda c: (known[c].tokens_per_s, c == calm))
    if not known[best].beats(known[calm], tolerance):
        return calm, note
    return best, (f"{_short(calm)} measured {_rate(known[calm])} at capacity against {_short(best)}'s "
                  f"{_rate(known[best])}")


def _switch_cost(held: EngineTarget, target: EngineTarget, known: Mapping[EngineTarget, Estimate],
                 pauses: Mapping[Switch, float], dwell_s: float) -> tuple[EngineTarget, str]:
    """`target`, or `held` where the switch's pause costs more tokens than it is expected to gain;
    a note when the rule weighed the switch (see the module docstring's "switch cost")."""
    pause_s = pauses.get((held, target))
    if target == held or pause_s is None or held not in known or target not in known:
        return target, ""
    rate = known[held].tokens_per_s
    gain = (known[target].tokens_per_s - rate) * dwell_s
    cost = rate * pause_s
    weighed = (f"{_short(target)}'s expected gain {gain:.0f} tokens over the {dwell_s:g} s dwell "
               f"({known[target].tokens_per_s - rate:+.0f} tok/s)")
    paused = f"the {cost:.0f} tokens its {pause_s * 1e3:.0f} ms pause loses at {rate:.0f} tok/s"
    if gain < cost:
        return held, f"switch cost: {weighed} < {paused}: {_short(held)} stays"
    return target, f"switch cost: {weighed} >= {paused}"


def _allowed(config: EngineTarget, spec: TuningSpec, limits: EngineLimits) -> bool:
    """A measured configuration the spec and the engine still allow (the spec may have changed)."""
    swap_ok = config.preemption_mode != "swap" or limits.swap_space_gib > 0
    return (config.block_size in spec.allowed_block_sizes and config.preemption_mode in spec.allowed_preemption_modes
            and swap_ok)


def _short(config: EngineTarget) -> str:
    return f"{config.block_size}/{config.preemption_mode}"


def _rate(estimate: Estimate) -> str:
    return f"{estimate.tokens_per_s:.0f} tok/s over {estimate.seconds:.0f} s"


def _pressure_triggers(sig: Signals, current: LiveConfig, spec: TuningSpec) -> list[str]:
    t, slo = spec.thresholds, spec.slo
    triggers = []
    if sig.queue_depth > t.queue_depth_high and not (spec.max_num_seqs and _seqs_bind(sig, current, t)):
        triggers.append(f"queue depth {sig.queue_depth:.1f} > {t.queue_depth_high:g}")
    if sig.preemptions_per_s > t.preemptions_per_s_high:
        triggers.append(f"preemptions {sig.preemptions_per_s:.2f}/s > {t.preemptions_per_s_high:g}/s")
    if (slo.ttft_p99_s is not None and sig.ttft_p99_s is not None and sig.ttft_p99_s > slo.ttft_p99_s
            and sig.queue_depth > t.queue_depth_low):
        triggers.append(f"P99 TTFT {sig.ttft_p99_s:.3f} s > target {slo.ttft_p99_s:g} s with queue depth "
                        f"{sig.queue_depth:.1f} > {t.queue_depth_low:g}")
    return triggers


def _resolve(wanted: EngineTarget, sig: Signals, spec: TuningSpec, limits: EngineLimits,
             current: LiveConfig) -> tuple[EngineTarget, str]:
    """`wanted` within what the spec and the engine allow, and a note where it had to differ."""
    block_size = min(spec.allowed_block_sizes,
                     key=lambda b: (abs(math.log2(b) - math.log2(wanted.block_size)), b))
    notes = [] if block_size == wanted.block_size else [f"block_size {wanted.block_size} is not allowed"]
    mode, why = _preemption_mode(wanted.preemption_mode, sig, spec, limits)
    if why:
        notes.append(why)
    return EngineTarget(block_size, mode or current.preemption_mode), "; ".join(notes)


def _preemption_mode(wanted: str, sig: Signals, spec: TuningSpec, limits: EngineLimits) -> tuple[str | None, str]:
    """The mode to use and why it is not `wanted`; None when no allowed mode is usable (only swap
    allowed and no swap space: the CRD refuses that spec, and the mode in force stays)."""
    allowed = spec.allowed_preemption_modes
    if wanted == "recompute":
        if "recompute" in allowed:
            return "recompute", ""
        return ("swap", "recompute is not allowed") if limits.swap_space_gib > 0 else (None, "recompute is not allowed and there is no swap space")
    floor, context = spec.thresholds.swap_min_context_tokens, sig.mean_context_tokens
    if "swap" not in allowed:
        why = "swap is not allowed"
    elif limits.swap_space_gib <= 0:
        why = "no swap space (--swap-space 0)"
    elif floor == 0:
        return "swap", ""
    elif context is not None and context >= floor:
        return "swap", f"mean context {context:.0f} >= {floor} tokens, cheaper to swap"
    else:
        shown = "unknown" if context is None else f"{context:.0f}"
        why = f"mean context {shown} < {floor} tokens, cheaper to recompute"
        if "recompute" not in allowed:
            return "swap", f"{why}, but recompute is not allowed"
    return ("recompute", why) if "recompute" in allowed else (None, why)


def _describe(target: EngineTarget, note: str) -> str:
    text = f"block_size {target.block_size}, {target.preemption_mode}"
    return f"{text} ({note})" if note else text


def _seqs_bind(sig: Signals, current: LiveConfig, t: Thresholds) -> bool:
    """Requests queue while memory is idle and every sequence slot is taken."""
    return (sig.queue_depth > t.queue_depth_low and sig.kv_cache_usage < t.kv_cache_usage_low
            and sig.num_running_seqs >= _AT_LIMIT * current.max_num_seqs)


def _max_num_seqs(sig: Signals, current: LiveConfig, spec: TuningSpec) -> tuple[int, str]:
    bounds, t, now = spec.max_num_seqs, spec.thresholds, current.max_num_seqs
    if bounds is None:
        return now, ""
    if _seqs_bind(sig, current, t):
        new = bounds.clamp(now * 2)
        why = (f"max_num_seqs binds (running {sig.num_running_seqs:.1f} of {now}, KV usage "
               f"{sig.kv_cache_usage:.2f} < {t.kv_cache_usage_low:g}, queue depth {sig.queue_depth:.1f})")
    elif sig.preemptions_per_s > t.preemptions_per_s_high and sig.kv_cache_usage > t.kv_cache_usage_high:
        new = bounds.clamp(now // 2)
        why = (f"memory binds (KV usage {sig.kv_cache_usage:.2f} > {t.kv_cache_usage_high:g}, preemptions "
               f"{sig.preemptions_per_s:.2f}/s > {t.preemptions_per_s_high:g}/s)")
    else:
        return now, ""
    if new == now:
        return now, f"{why}: max_num_seqs stays {now}, at its bound"
    return new, f"{why}: max_num_seqs {now} -> {new}"


def _measured_limits(held: Knobs, seqs: int, tokens: int, measured: Mapping[Knobs, Estimate],
                     tolerance: float) -> tuple[int, int, str]:
    """`seqs` and `tokens`, unless they and `held`'s limits were both measured (at `held`'s block
    size and mode) and they got through no more: then `held`'s, and why."""
    wanted = dataclasses.replace(held, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    mine, theirs = measured.get(held), measured.get(wanted)
    if wanted == held or mine is None or theirs is None or theirs.beats(mine, tolerance):
        return seqs, tokens, ""
    return held.max_num_seqs, held.max_num_batched_tokens, (
        f"max_num_seqs {seqs}, max_num_batched_tokens {tokens} measured {_rate(theirs)} against {_rate(mine)} "
        f"at max_num_seqs {held.max_num_seqs}, max_num_batched_tokens {held.max_num_batched_tokens}: those stay")


def _max_num_batched_tokens(sig: Signals, current: LiveConfig, spec: TuningSpec,
                            limits: EngineLimits) -> tuple[int, str]:
    bounds, slo, now = spec.max_num_batched_tokens, spec.slo, current.max_num_batched_tokens
    if bounds is None:
        return now, ""
    ttft_over = slo.ttft_p99_s is not None and sig.ttft_p99_s is not None and sig.ttft_p99_s > slo.ttft_p99_s
    itl_over = slo.itl_p99_s is not None and sig.itl_p99_s is not None and sig.itl_p99_s > slo.itl_p99_s
    floor = max(bounds.min, limits.min_batched_tokens)
    if itl_over and not ttft_over:
        new = max(floor, min(bounds.max, now // 2))
        why = f"P99 ITL {sig.itl_p99_s:.3f} s > target {slo.itl_p99_s:g} s, TTFT within its target"
    elif ttft_over and not itl_over:
        new = max(floor, min(bounds.max, now * 2))
        why = f"P99 TTFT {sig.ttft_p99_s:.3f} s > target {slo.ttft_p99_s:g} s, ITL within its target"
    else:
        return now, ""
    if new == now or new > bounds.max:
        return now, f"{why}: max_num_batched_tokens stays {now}, at its bound"
    return new, f"{why}: max_num_batched_tokens {now} -> {new}"
