"""`kvpilot bench serve` against a real `kvpilot serve` process on the embedded model: JSON and PNG
with figures that hang together, the server's gauges, and the rate search on a stand-in probe."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import free_port

from kvpilot.bench import serve
from kvpilot.bench.capacity_curve import parse_curve
from kvpilot.bench.slo import parse_slo

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}
SHAREGPT = Path(__file__).parent / "data" / "sharegpt-two.json"  # two conversations
SHAREGPT_REPLIES = [c["conversations"][1]["value"] for c in json.loads(SHAREGPT.read_text())]


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([KVPILOT, "serve", "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "8",
                             "--disable-log-stats", "--log-level", "warning"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            assert proc.poll() is None, f"kvpilot serve exited: {proc.stderr.read() if proc.stderr else ''}"
            try:
                if httpx.get(f"{base}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvpilot serve did not become ready"
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser(prog="kvpilot bench serve")
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_two_rates_write_json_and_png_with_sane_figures(served: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "curve" / "serve.json"
    args = parse("--base-url", served, "--num-prompts", "8", "--random-input-len", "24", "--random-output-len", "32",
                 "--ignore-eos", "--request-rate", "2", "inf", "--slo", "ttft=60s,itl=10s", "--output", str(out),
                 "--disable-tqdm")
    assert serve.run(args) == 0
    body = json.loads(out.read_text())
    assert body["model"] == "SmolLM2-135M-Instruct"
    assert [r["request_rate"] for r in body["runs"]] == [2.0, "inf"]
    for run in body["runs"]:
        assert run["completed"] == 8 and run["failed"] == 0 and run["errors"] == {}
        assert run["total_output_tokens"] == 8 * 32 and run["total_input_tokens"] == 8 * 24
        for key in ("ttft", "itl", "e2e"):
            stats = run[key]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
        assert run["ttft"]["p99"] <= run["e2e"]["p99"]
        assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration_s"])
        assert run["goodput"] == pytest.approx(run["request_throughput"]) and run["meets_slo"]
        assert 0 <= run["kv_cache_usage"] <= 1 and run["num_requests_waiting"] >= 0
        assert run["preemptions_per_s"] == 0
    # all 8 at once: the server's scrapes during the run see them in its KV cache and running
    unbounded = body["runs"][1]
    assert 0 < unbounded["kv_cache_usage"] <= 1 and unbounded["num_requests_running"] > 1
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "request rate 2 req/s" in printed and "TTFT p99 (ms)" in printed and f"wrote {out}" in printed


def test_a_tight_slo_counts_no_goodput_and_a_concurrency_cap_holds(served: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    args = parse("--base-url", served, "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "8",
                 "--ignore-eos", "--max-concurrency", "2", "--slo", "ttft=0.001ms", "--output", str(out),
                 "--disable-tqdm")
    assert serve.run(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 6 and run["goodput"] == 0 and not run["meets_slo"]
    assert run["max_concurrency"] == 2 and run["num_requests_running"] <= 2


def test_a_dataset_of_text_prompts_is_served(served: str, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "What is the capital of France?", "output_len": 5}\n{"prompt": "Hello"}\n')
    out = tmp_path / "serve.json"
    args = parse("--base-url", served, "--dataset-path", str(data), "--num-prompts", "4", "--random-output-len", "3",
                 "--ignore-eos", "--output", str(out), "--disable-tqdm")
    assert serve.run(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 4 and run["total_output_tokens"] == 5 + 3 + 5 + 3
    assert run["total_input_tokens"] > 4


def test_a_sharegpt_file_is_served_with_its_replies_lengths(served: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kvpilot.runtime.model_source import resolve_model

    folder = resolve_model(None).tokenizer
    assert folder is not None
    out = tmp_path / "serve.json"
    args = parse("--base-url", served, "--dataset-path", str(SHAREGPT), "--tokenizer", folder, "--num-prompts", "2",
                 "--ignore-eos", "--output", str(out), "--disable-tqdm")
    assert serve.run(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = sum(len(tokenizer.encode(r)) for r in SHAREGPT_REPLIES)
    assert run["completed"] == 2 and run["total_output_tokens"] == expected


def test_a_sharegpt_file_without_a_tokenizer_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([KVPILOT, "bench", "serve", "--dataset-path", str(SHAREGPT), "--base-url", "http://127.0.0.1:9"],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "ShareGPT JSON" in done.stderr and "--tokenizer" in done.stderr
    done = subprocess.run([KVPILOT, "bench", "serve", "--dataset-path", str(SHAREGPT), "--tokenizer", str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tokenizer" in done.stderr and "no tokenizer.json" in done.stderr


def test_errors_from_the_server_are_counted_not_raised(served: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    args = parse("--base-url", served, "--num-prompts", "3", "--random-input-len", "600", "--random-output-len", "4",
                 "--output", str(out), "--disable-tqdm")
    assert serve.run(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 0 and run["failed"] == 3
    [(error, count)] = run["errors"].items()
    assert count == 3 and "HTTP 400" in error and "512" in error


def test_search_brackets_then_bisects_the_highest_rate_meeting_the_slo() -> None:
    probed: list[float] = []

    async def probe(rate: float) -> dict[str, object]:
        probed.append(rate)
        return {"request_rate": rate, "meets_slo": rate <= 5.3}

    runs: list[dict[str, object]] = []
    result = asyncio.run(serve._search(probe, runs, 1.0, parse_slo("ttft=1s"), steps=3))
    assert probed == [1, 2, 4, 8, 6, 5, 5.5]
    assert result["highest_rate_meeting_slo"] == 5 and result["lowest_rate_missing_slo"] == 5.5
    assert len(runs) == len(probed)


def test_search_halves_when_the_first_rate_misses() -> None:
    async def probe(rate: float) -> dict[str, object]:
        return {"request_rate": rate, "meets_slo": rate <= 3}

    result = asyncio.run(serve._search(probe, [], 16.0, parse_slo("ttft=1s"), steps=1))
    assert result["highest_rate_meeting_slo"] == 3.0 and result["lowest_rate_missing_slo"] == 4.0


def test_the_output_is_a_capacity_curve_for_the_autoscaler() -> None:
    run = {"request_throughput": 1.0, "ttft": {"p50": 0.1, "p90": 0.2, "p99": 0.3},
           "itl": {"p50": 0.01, "p90": 0.02, "p99": 0.03}, "e2e": {"p50": 1, "p90": 2, "p99": 3},
           "kv_cache_usage": 0.2, "num_requests_waiting": 0.0, "num_requests_running": 2.0, "preemptions_per_s": 0.0}
    curve = parse_curve({"runs": [{**run, "request_rate": 1.0}, {**run, "request_rate": 2.0, "request_throughput": 2.0}]})
    assert curve.gauges == ("kv_cache_usage", "num_requests_waiting", "num_requests_running", "preemptions_per_s")


@pytest.mark.parametrize(("flags", "named"), [
    (["--request-rate", "0"], "--request-rate"),
    (["--slo", "ttft=fast"], "ttft"),
    (["--search"], "--search"),
    (["--search", "--slo", "ttft=1s", "--request-rate", "1", "2"], "--search"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--num-prompts", "-1"], "--num-prompts"),
    (["--dataset-path", "/no/such.jsonl"], "/no/such.jsonl"),
    (["--base-url", "http://127.0.0.1:9"], "cannot reach the server"),
])
def test_bad_input_fails_with_one_line(flags: list[str], named: str) -> None:
    result = subprocess.run([KVPILOT, "bench", "serve", "--disable-tqdm", *flags], capture_output=True, text=True,
                            env=ENV, timeout=60)
    assert result.returncode in (1, 2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "error" in lines[0], result.stderr
