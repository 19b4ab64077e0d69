"""Two tenants on the embedded SmolLM2 (CPU): per-tenant throughput and TTFT under each scheduler policy.

Arrivals follow engine steps, not the clock, so the load relative to capacity is the same on a fast
or a slow machine: every 12 steps the light tenant sends one request and the heavy tenant ten (ten
times the load). Each request has a 32-token prompt and 16 new tokens (greedy, EOS ignored), and
at most 4 run at once, so the engine serves about one request in four steps: the heavy tenant alone
asks for ~3.5x that, the light one for ~1/3, under its fair half. Arrivals stop after --steps
steps and the run stops there too, so a queue that only grows shows as requests never started.
Under `priority` the light tenant's requests have priority 0 and the heavy's 1 (default aging).

Per tenant: output tokens served per engine step and per second of run, and TTFT (arrival to first
token) P50/P99 in steps and in seconds, of the requests that got a first token (how many did is
shown). Per policy: all output tokens per step, against fcfs (the policy's cost in batch
composition, which the machine's speed does not move), per second, and the scheduler's own time per
step (the policy's bookkeeping). Seconds move with the machine's load; steps do not.
Usage: PYTHONSAFEPATH=1 .venv/bin/python benchmarks/bench_fair_cpu.py [--steps 144] [--output fair.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import time
from typing import Any

import torch

from kvpilot.bench.percentile import percentile
from kvpilot.runtime import LLM, SamplingParams

PROMPT_LEN, NEW_TOKENS, MAX_NUM_SEQS, PERIOD = 32, 16, 4, 12
TENANTS = ("heavy", "light")


def arrivals(step: int) -> list[str]:
    """The tenants of the requests that arrive before step `step`: one light, ten heavy per period."""
    k = step % PERIOD
    if k == 0:
        return ["light"]
    return ["heavy"] if k != 6 else []


def run(llm: LLM, policy: str, num_steps: int, seed: int) -> dict[str, Any]:
    engine = llm.engine
    engine.update_config({"scheduler_policy": policy})  # live, as /admin/config does; fair starts at zero
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    schedule_s = [0.0]

    def timed_schedule() -> Any:  # the policy's cost: the scheduler's own time, apart from the model's
        t0 = time.perf_counter()
        try:
            return schedule()
        finally:
            schedule_s[0] += time.perf_counter() - t0

    scheduler.schedule = timed_schedule  # type: ignore[method-assign]
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tenant_of: dict[str, str] = {}
    arrived: dict[str, tuple[int, float]] = {}  # (step, time)
    first_token: dict[str, tuple[int, float]] = {}
    served = {t: 0 for t in TENANTS}
    start = time.perf_counter()
    try:
        for step in range(num_steps):
            for tenant in arrivals(step):
                rid = f"{tenant}-{len(tenant_of)}"
                tenant_of[rid] = tenant
                prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)]
                request = engine.add_request(rid, prompt, params, priority=0 if tenant == "light" else 1,
                                             tenant=tenant)
                arrived[rid] = (step, request.arrival_time)
            for out in engine.step():
                if out.request_id not in first_token and out.metrics is not None and out.metrics.first_token_time:
                    first_token[out.request_id] = (step, out.metrics.first_token_time)
            if engine.last_step is not None:
                for tenant, (_, generated) in engine.last_step.served_tokens.items():
                    served[tenant] += generated
    finally:
        del scheduler.schedule
    elapsed = time.perf_counter() - start
    for rid in list(engine.requests):
        engine.abort_request(rid)
    result: dict[str, Any] = {"policy": policy, "seconds": elapsed, "steps": num_steps, "tenants": {},
                              "schedule_ms_per_step": 1000 * schedule_s[0] / num_steps}
    for tenant in TENANTS:
        rids = [r for r, t in tenant_of.items() if t == tenant]
        started = [r for r in rids if r in first_token]
        ttft_steps = [first_token[r][0] - arrived[r][0] for r in started]
        ttft_s = [first_token[r][1] - arrived[r][1] for r in started]
        result["tenants"][tenant] = {
            "requests": len(rids), "started": len(started), "output_tokens": served[tenant],
            "tokens_per_step": served[tenant] / num_steps, "tokens_per_s": served[tenant] / elapsed,
            **{f"ttft_p{q}_{unit}": percentile(values, q) if values else None
               for unit, values in (("steps", ttft_steps), ("s", ttft_s)) for q in (50, 99)},
        }
    result["total_tokens_per_step"] = sum(served.values()) / num_steps
    result["total_tokens_per_s"] = sum(served.values()) / elapsed
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=144)
    parser.add_argument("--policies", default="fcfs,fair,priority")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    llm = LLM(max_model_len=1024, max_num_seqs=MAX_NUM_SEQS, seed=0)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))  # warm-up: kernels, caches
    policies = args.policies.split(",")
    if len(set(policies)) != len(policies):
        parser.error("--policies: name each policy once (a policy's state starts fresh when switched to)")
    results = []
    for policy in policies:
        results.append(run(llm, policy, args.steps, args.seed))
        print(f"{policy}: done in {results[-1]['seconds']:.0f} s", flush=True)
    base = next((r for r in results if r["policy"] == "fcfs"), None)

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print("per tenant: requests arrived / got a first token, output tokens per step and per second, TTFT P50/P99 "
          "in steps and seconds; total: output tokens per step (vs fcfs), per second, scheduler ms per step")
    print(f"{'policy':<9}{'tenant':<7}{'arrived':>8}{'started':>8}{'tok/step':>9}{'tok/s':>7}{'TTFT p50/p99 steps':>19}"
          f"{'TTFT p50/p99 s':>16}  total tok/step (vs fcfs), tok/s, sched ms/step")
    for r in results:
        for i, tenant in enumerate(TENANTS):
            t = r["tenants"][tenant]
            ttft_steps = f"{fmt(t['ttft_p50_steps'], 'd')}/{fmt(t['ttft_p99_steps'], 'd')}"
            ttft_s = f"{fmt(t['ttft_p50_s'], '.1f')}/{fmt(t['ttft_p99_s'], '.1f')}"
            tail = ""
            if i == 0:
                ratio = fmt(r["total_tokens_per_step"] / base["total_tokens_per_step"] if base else None, ".3f")
                tail = (f"  {r['total_tokens_per_step']:.2f} ({ratio}), {r['total_tokens_per_s']:.1f}, "
                        f"{r['schedule_ms_per_step']:.2f}")
            print(f"{r['policy']:<9}{tenant:<7}{t['requests']:>8}{t['started']:>8}{t['tokens_per_step']:>9.2f}"
                  f"{t['tokens_per_s']:>7.1f}{ttft_steps:>19}{ttft_s:>16}{tail}")
    if args.output:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"commit": commit, "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps,
                "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "max_num_seqs": MAX_NUM_SEQS}
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
