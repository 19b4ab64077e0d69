"""Two tenants on the embedded SmolLM2 (CPU): per-tenant throughput and TTFT under each scheduler policy.

Arrivals follow engine steps, not the clock, so the load relative to capacity is the same on a fast
or a slow machine: every 12 steps the light tenant sends one request and the heavy tenant ten (ten
times the load). Each request has a 32-token prompt and 16 new tokens (greedy, EOS ignored), and
at most 4 run at once, so the engine serves about one request in four steps: the heavy tenant alone
asks for ~3.5x that, the light one for ~1/3, under its fair half. Arrivals stop after --steps
steps and the run stops there too, so a queue that only grows shows as requests never started.
Under `priority` the light tenant's requests have priority 0 and the heavy's 1 (default aging).

Per tenant: output tokens served per second of run, and TTFT (arrival to first token) P50/P99 of
the requests that got a first token, with how many got none. "total" is all output tokens per
second; the last column is that against fcfs in the same process.
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

from kvpilot.runtime import LLM, SamplingParams

PROMPT_LEN, NEW_TOKENS, MAX_NUM_SEQS, PERIOD = 32, 16, 4, 12
TENANTS = ("heavy", "light")


def arrivals(step: int) -> list[str]:
    """The tenants of the requests that arrive before step `step`: one light, ten heavy per period."""
    k = step % PERIOD
    if k == 0:
        return ["light"]
    return ["heavy"] if k != 6 else []


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def run(llm: LLM, policy: str, num_steps: int, seed: int) -> dict[str, Any]:
    engine = llm.engine
    engine.update_config({"scheduler_policy": policy})  # live, as /admin/config does; fair starts at zero
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tenant_of: dict[str, str] = {}
    first_token: dict[str, float] = {}
    arrived: dict[str, float] = {}
    served = {t: 0 for t in TENANTS}
    start = time.perf_counter()
    for step in range(num_steps):
        for tenant in arrivals(step):
            rid = f"{tenant}-{len(tenant_of)}"
            tenant_of[rid] = tenant
            prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)]
            request = engine.add_request(rid, prompt, params, priority=0 if tenant == "light" else 1, tenant=tenant)
            arrived[rid] = request.arrival_time
        for out in engine.step():
            if out.request_id not in first_token and out.metrics is not None and out.metrics.first_token_time:
                first_token[out.request_id] = out.metrics.first_token_time
        if engine.last_step is not None:
            for tenant, (_, generated) in engine.last_step.served_tokens.items():
                served[tenant] += generated
    elapsed = time.perf_counter() - start
    for rid in list(engine.requests):
        engine.abort_request(rid)
    result: dict[str, Any] = {"policy": policy, "seconds": elapsed, "steps": num_steps, "tenants": {}}
    for tenant in TENANTS:
        rids = [r for r, t in tenant_of.items() if t == tenant]
        ttft = [first_token[r] - arrived[r] for r in rids if r in first_token]
        result["tenants"][tenant] = {
            "requests": len(rids), "started": len(ttft), "output_tokens": served[tenant],
            "tokens_per_s": served[tenant] / elapsed,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        }
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
    base = next((r["total_tokens_per_s"] for r in results if r["policy"] == "fcfs"), None)

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(f"{'policy':<9}{'tenant':<7}{'requests':>9}{'started':>8}{'tok/s':>8}{'TTFT p50 s':>11}{'TTFT p99 s':>11}"
          f"{'total tok/s':>12}{'vs fcfs':>8}")
    for r in results:
        for i, tenant in enumerate(TENANTS):
            t = r["tenants"][tenant]
            tail = (f"{r['total_tokens_per_s']:>12.1f}{fmt(r['total_tokens_per_s'] / base if base else None, '.3f'):>8}"
                    if i == 0 else "")
            print(f"{r['policy']:<9}{tenant:<7}{t['requests']:>9}{t['started']:>8}{t['tokens_per_s']:>8.1f}"
                  f"{fmt(t['ttft_p50_s'], '.2f'):>11}{fmt(t['ttft_p99_s'], '.2f'):>11}{tail}")
    if args.output:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"commit": commit, "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps,
                "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "max_num_seqs": MAX_NUM_SEQS}
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
