"""`kvpilot bench startup`: `kvpilot serve` from process start to `/ready`, phase by phase.

Each run starts a fresh `kvpilot serve` (this interpreter, `-m kvpilot.runtime.cli`, so an
uninstalled tree on PYTHONPATH works), polls `GET /ready` until it answers 200, reads the start-up
record the server measured itself (runtime/startup.py: every phase of the API process and the
engine core), sends one request to show that it serves, optionally waits for the record of the
work done after Ready, and stops it. Runs repeat with the page cache *warm* (the checkpoint read
just before) and *cold* (the checkpoint's pages dropped: `/proc/sys/vm/drop_caches` as root,
else `posix_fadvise(DONTNEED)` on each file, which evicts exactly the weights; the report says
which). The disk's read rate is measured the same way, by reading the checkpoint cold.

Without `--model` it times the embedded model; `--write-checkpoint PRESET` writes a folder of
random weights of that preset's shape once (bench/random_checkpoint.py) and times that.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvpilot.runtime.model_source import cache_root, load_preset, preset_names

from .flags import non_negative_float, positive_float, positive_int
from .random_checkpoint import write_checkpoint

READ_CHUNK = 64 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--write-checkpoint", default=None, metavar="PRESET", choices=preset_names(),
                        help="write random weights of this preset's shape once (e.g. llama-3-8b) and time them")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="where --write-checkpoint writes (default $KVPILOT_CACHE/startup/PRESET)")
    parser.add_argument("--runs", type=positive_int, default=3, help="starts per condition; the table shows medians")
    parser.add_argument("--cache", nargs="+", choices=("warm", "cold"), default=["warm", "cold"],
                        help="page-cache conditions to time (cold needs a checkpoint folder)")
    parser.add_argument("--evict", choices=("page-cache", "checkpoint"), default="page-cache",
                        help="cold: drop the whole page cache (root; falls back to the checkpoint's pages where "
                             "not allowed) or only the checkpoint's pages (kind to a shared machine)")
    parser.add_argument("--readers", nargs="+", default=["auto"], choices=("auto", "safetensors", "fastsafetensors"),
                        help="weight readers to compare (KVPILOT_WEIGHT_READER of each run)")
    parser.add_argument("--serve-args", default="",
                        help="more `kvpilot serve` flags, one string (--serve-args='--enforce-eager')")
    parser.add_argument("--wait-after-ready", type=non_negative_float, default=0.0, metavar="SECONDS",
                        help="also wait up to this long for the work done after Ready (other block sizes)")
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds a start may take")
    parser.add_argument("--output", default=None, help="JSON results (and a PNG beside it)")


def run(args: argparse.Namespace) -> int:
    model = args.model
    result: dict[str, Any] = {"host": os.uname().nodename, "runs": args.runs}
    if args.write_checkpoint:
        folder = Path(args.checkpoint_dir or cache_root() / "startup" / args.write_checkpoint)
        written, seconds = write_checkpoint(load_preset(args.write_checkpoint), folder)
        result["checkpoint"] = {"preset": args.write_checkpoint, "written": written, "seconds": round(seconds, 1)}
        print(f"checkpoint {folder}: " + (f"written in {seconds:.1f} s" if written else "already there"))
        model = str(folder)
    files = sorted(Path(model).glob("*.safetensors")) if model else []
    if "cold" in args.cache and not files:
        print("kvpilot bench startup: error: --cache cold needs a checkpoint folder (--model or --write-checkpoint)",
              file=sys.stderr)
        return 2
    if files:
        result["checkpoint_bytes"] = sum(f.stat().st_size for f in files)
        result["disk"] = disk_read_rates(files, args.evict)
        print(f"disk: {result['disk']}")
    flags = (["--model", model] if model else []) + args.serve_args.split()
    result["serve_flags"] = flags
    result["conditions"] = []
    for reader in args.readers:
        for cache in args.cache:
            runs = []
            for i in range(args.runs):
                if cache == "cold":
                    drop_page_cache(files, args.evict)
                elif files:
                    read_files(files)
                one = start_once(flags, reader, args.timeout, args.wait_after_ready)
                print(f"{reader} {cache} run {i + 1}: ready in {one['ready_wall_s']:.2f} s")
                runs.append(one)
            result["conditions"].append({"reader": reader, "cache": cache, "runs": runs, "median": medians(runs)})
    print_table(result)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        plot(result, out.with_suffix(".png"))
    return 0


# ---- the page cache and the disk ---------------------------------------------------------------

def drop_page_cache(files: list[Path], evict: str = "page-cache") -> str:
    """Evict the checkpoint's pages; how: 'drop_caches' (the whole page cache, as root) or
    'fadvise' (each file's own pages, any user: also where drop_caches is not allowed)."""
    os.sync()
    try:
        if evict != "page-cache":
            raise PermissionError("asked for the checkpoint's pages only")
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def read_files(files: list[Path]) -> int:
    """Read every file once, in large chunks, into one reused buffer; the bytes read."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    total = 0
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def disk_read_rates(files: list[Path], evict: str) -> dict[str, Any]:
    """GB/s of one sequential reader over the checkpoint, cold (as the cold starts drop it) and warm."""
    how = drop_page_cache(files, evict)
    start = time.perf_counter()
    size = read_files(files)
    cold = size / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    read_files(files)
    warm = size / (time.perf_counter() - start) / 1e9
    return {"cold_gb_per_s": round(cold, 3), "warm_gb_per_s": round(warm, 3), "eviction": how}


# ---- one start ---------------------------------------------------------------------------------

def free_port() -> int:
    # not bench/server_process.py's: that module needs aiohttp, which a GPU image may lack
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_once(flags: list[str], reader: str, timeout: float, wait_after_ready: float) -> dict[str, Any]:
    """One `kvpilot serve` from Popen to /ready 200, its own record, one request, then stop."""
    port = free_port()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvpilot-startup-{port}.log"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "KVPILOT_WEIGHT_READER": reader}
    cmd = [sys.executable, "-m", "kvpilot.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        body = _wait_ready(base, proc, log_path, started + timeout)
        ready = time.time()
        cpu_s = cpu_seconds(proc.pid)  # load-independent: what the start cost, not how long it waited
        request_s = _one_request(base)
        after = _wait_after_ready(base, log_path, wait_after_ready) if wait_after_ready > 0 else None
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    record = body.get("startup") or {}
    log_path.unlink(missing_ok=True)
    return {"ready_wall_s": round(ready - started, 3), "ready_s": record.get("ready_s"), "cpu_s": cpu_s,
            "phases": record.get("phases", []), "first_request_s": round(request_s, 3), "after_ready": after}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) that a process and its descendants have used so far, from /proc
    (0 where unreadable)."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (OSError, ValueError, IndexError):
        return total
    return round(total + sum(cpu_seconds(c) for c in children), 2)


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log_path: Path, deadline: float) -> dict[str, Any]:
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text().strip().splitlines()[-5:]
            raise RuntimeError(f"kvpilot serve exited with {proc.returncode}: {' | '.join(tail)}")
        try:
            status, body = _get(f"{base}/ready", timeout=2.0)
            if status == 200:
                return dict(json.loads(body))
        except (OSError, ValueError):
            pass  # not listening yet
        if time.time() > deadline:
            raise RuntimeError(f"kvpilot serve was not ready in time (log: {log_path})")
        time.sleep(0.01)


def _one_request(base: str) -> float:
    """Seconds for one 4-token completion of a token-id prompt (the model may have no tokenizer)."""
    status, body = _get(f"{base}/v1/models")
    model = json.loads(body)["data"][0]["id"]
    payload = json.dumps({"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=payload,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        if response.status != 200:
            raise RuntimeError(f"the first request failed: {response.status}")
        response.read()
    return time.perf_counter() - start


def _wait_after_ready(base: str, log_path: Path, seconds: float) -> dict[str, Any] | None:
    """The core's record of the work it did after Ready, once `/health` says it is done; None if
    not within `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        found = re.search(r"after ready: (\{.*\})", log_path.read_text())
        if found and not json.loads(_get(f"{base}/health")[1]).get("warming_up", True):
            return dict(json.loads(found.group(1)))
        time.sleep(0.2)
    return None


# ---- the report --------------------------------------------------------------------------------

def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over runs of the wall time to Ready, the first request, and each phase's seconds."""
    phases: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    details: dict[str, dict[str, Any]] = {}
    for one in runs:
        for p in one["phases"]:
            key = f"{p['process']}:{p['name']}"
            phases.setdefault(key, []).append(p["seconds"])
            cpu.setdefault(key, []).append(p.get("cpu_s", 0.0))
            details[key] = {k: v for k, v in p.items() if k not in ("name", "process", "start_s", "seconds", "cpu_s")}
    return {"ready_wall_s": statistics.median(r["ready_wall_s"] for r in runs),
            "cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "first_request_s": statistics.median(r["first_request_s"] for r in runs),
            "phases": {k: {"seconds": round(statistics.median(v), 3), "cpu_s": round(statistics.median(cpu[k]), 3),
                           **details[k]} for k, v in phases.items()}}


def print_table(result: dict[str, Any]) -> None:
    conditions = result["conditions"]
    names = list(dict.fromkeys(k for c in conditions for k in c["median"]["phases"]))
    heads = [f"{c['reader']}/{c['cache']}" for c in conditions]
    print(f"\nmedian of {result['runs']} runs; seconds, wall and CPU (phases of the API process 'api:' and the "
          "engine core 'core:' overlap: the core starts while the API process loads)")
    print(f"{'phase':<24}" + "".join(f"{h + ' wall   cpu':>26}" for h in heads))
    for name in names:
        cells = []
        for c in conditions:
            p = c["median"]["phases"].get(name)
            cells.append(f"{p['seconds']:>20.3f}{p['cpu_s']:>6.2f}" if p else f"{'-':>26}")
        print(f"{name:<24}" + "".join(cells))
    for label, key in (("process start -> Ready", "ready_wall_s"), ("CPU seconds to Ready", "cpu_s"),
                       ("first request", "first_request_s")):
        print(f"{label:<24}" + "".join(f"{c['median'][key]:>20.3f}{'':>6}" for c in conditions))
    if "disk" in result:
        gb = result["checkpoint_bytes"] / 1e9
        print(f"checkpoint {gb:.2f} GB; one reader: {result['disk']['cold_gb_per_s']} GB/s cold, "
              f"{result['disk']['warm_gb_per_s']} GB/s warm (eviction: {result['disk']['eviction']})")


def plot(result: dict[str, Any], path: Path) -> None:
    """Each condition's phases as bars on the time axis from process start (medians' first run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    conditions = result["conditions"]
    fig, axes = plt.subplots(len(conditions), 1, figsize=(10, 1 + 2.5 * len(conditions)), squeeze=False)
    for ax, c in zip(axes[:, 0], conditions, strict=True):
        phases = c["runs"][0]["phases"]
        for row, p in enumerate(phases):
            ax.barh(row, p["seconds"], left=p["start_s"], color="tab:blue" if p["process"] == "api" else "tab:orange")
        ax.set_yticks(range(len(phases)), [f"{p['process']}:{p['name']}" for p in phases], fontsize=7)
        ax.axvline(c["runs"][0]["ready_s"] or 0, color="k", linestyle="--")
        ax.set_title(f"{c['reader']}, page cache {c['cache']}: ready at {c['median']['ready_wall_s']:.2f} s", fontsize=9)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds after the process started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
