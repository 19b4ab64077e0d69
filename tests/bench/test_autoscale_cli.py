"""`kvpilot bench autoscale` end to end through its add_arguments/run: a short day written as
JSON and PNG, the table, and one clear error line for bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpilot.bench import autoscale

EXAMPLE = Path(__file__).parent / "data" / "example-capacity-curve.json"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpilot bench autoscale")
    autoscale.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_short_day_writes_json_and_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "autoscale.json"
    args = parse("--capacity-curve", str(EXAMPLE), "--duration", "3600", "--peak-rate", "40",
                 "--self-check-requests", "3000", "--output", str(out), "--disable-tqdm")
    assert autoscale.run(args) == 0
    body = json.loads(out.read_text())
    names = [p["policy"] for p in body["policies"]]
    assert names == ["static-peak", "hpa-queue", "builtin-kvCacheUsage", "builtin-waitingPerReplica",
                     "builtin-preemptionRate", "builtin-ttftP99", "reactive-bound", "clairvoyant",
                     "builtin-kvCacheUsage@0.85"]
    static = body["policies"][0]
    assert static["replica_hours_vs_static"] == 1.0 and static["num_scale_events"] == 0
    assert static["max_replicas"] >= body["trace"]["peak"] / body["curve"]["slo_rate_per_replica"]
    assert all(0 <= p["slo_attainment"] <= 1 and p["replica_hours"] > 0 for p in body["policies"])
    assert len({p["num_requests"] for p in body["policies"]}) == 1  # the same arrivals for every policy
    assert all(p["num_outside_slo"] == round(p["num_requests"] * (1 - p["slo_attainment"])) for p in body["policies"])
    assert body["self_check"]["passed"] and body["self_check"]["max_error"] <= 0.10
    # the yardsticks: knowing the load ahead never does worse than knowing it now
    by_name = {p["policy"]: p for p in body["policies"]}
    assert by_name["clairvoyant"]["slo_attainment"] >= by_name["reactive-bound"]["slo_attainment"]
    assert body["curve"]["description"].startswith("EXAMPLE, NOT A MEASUREMENT")
    assert len(body["timeline"]["builtin-ttftP99"]["replicas"]) == 60
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "self-check passed" in printed and "builtin-kvCacheUsage@0.85" in printed
    assert f"wrote {out}" in printed


def test_a_trace_file_replaces_the_built_in_day_and_the_hpa_target_can_be_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,rate\n0,5\n600,5\n660,30\n1200,30\n")
    args = parse("--capacity-curve", str(EXAMPLE), "--trace", str(trace), "--self-check-requests", "2000",
                 "--hpa-target", "5", "--disable-tqdm")
    assert autoscale.run(args) == 0
    table = capsys.readouterr().out
    assert "static-peak" in table and "3 replicas (30.0 req/s / 10.29 per replica)" in table
    assert "waiting 5 per pod" in table


def test_several_headrooms_simulate_each_policy_at_each_and_show_each_at_its_best(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "autoscale.json"
    args = parse("--capacity-curve", str(EXAMPLE), "--duration", "3600", "--peak-rate", "40",
                 "--self-check-requests", "2000", "--headroom", "0.6", "0.8", "--output", str(out), "--disable-tqdm")
    assert autoscale.run(args) == 0
    body = json.loads(out.read_text())
    policies = {p["policy"]: p for p in body["policies"]}
    assert {"builtin-kvCacheUsage h0.8", "builtin-kvCacheUsage h0.6", "hpa-queue h0.8", "hpa-queue h0.6",
            "static-peak", "builtin-kvCacheUsage@0.85"} <= set(policies)
    assert body["families"]["builtin-kvCacheUsage h0.6"] == "builtin-kvCacheUsage"
    assert body["curve"]["target_rate_per_replica"] == pytest.approx({"0.8": 8.2286, "0.6": 6.1714}, rel=1e-3)
    # a lower headroom is a lower target: kvCacheUsage on the curve at 0.6 rather than 0.8 of the SLO rate
    def target(name: str) -> float:
        return float(policies[name]["target"].split()[-1])
    assert target("builtin-kvCacheUsage h0.6") < target("builtin-kvCacheUsage h0.8")
    goal = body["slo_goal"]
    for family, name in body["best"].items():
        settings = [p for n, p in policies.items() if body["families"][n] == family]
        meeting = [p for p in settings if p["slo_attainment"] >= goal]
        chosen = min(meeting, key=lambda p: p["replica_hours"]) if meeting else \
            max(settings, key=lambda p: p["slo_attainment"])
        assert policies[name] == chosen, family
    printed = capsys.readouterr().out
    assert "each policy at its best" in printed


def test_the_tolerance_reaches_every_policy_that_has_one(tmp_path: Path) -> None:
    events = {}
    for tolerance in ("0", "0.9"):
        out = tmp_path / f"tolerance-{tolerance}.json"
        args = parse("--capacity-curve", str(EXAMPLE), "--duration", "3600", "--peak-rate", "40",
                     "--self-check-requests", "2000", "--tolerance", tolerance, "--output", str(out), "--disable-tqdm")
        assert autoscale.run(args) == 0
        body = json.loads(out.read_text())
        assert body["tolerance"] == float(tolerance)
        events[tolerance] = {p["policy"]: p["num_scale_events"] for p in body["policies"]}
    # a ratio within 90% of the target moves nothing: far fewer scalings than at 0
    for name in ("hpa-queue", "builtin-kvCacheUsage", "builtin-waitingPerReplica"):
        assert events["0.9"][name] < events["0"][name], name
    # the yardsticks have no tolerance
    assert events["0.9"]["reactive-bound"] == events["0"]["reactive-bound"]


def test_a_written_trace_replays_the_built_in_day_exactly(tmp_path: Path) -> None:
    common = ("--capacity-curve", str(EXAMPLE), "--self-check-requests", "2000", "--disable-tqdm")
    trace = tmp_path / "day.csv"
    assert autoscale.run(parse(*common, "--duration", "1800", "--peak-rate", "40", "--write-trace", str(trace),
                               "--output", str(tmp_path / "built-in.json"))) == 0
    assert trace.read_text().startswith("time_s,rate\n0.0,")
    assert autoscale.run(parse(*common, "--trace", str(trace), "--output", str(tmp_path / "file.json"))) == 0
    built_in, replayed = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("built-in", "file"))
    assert replayed["policies"] == built_in["policies"]
    assert replayed["trace"]["peak"] == built_in["trace"]["peak"]


def test_a_curve_without_gauges_compares_what_it_can(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = json.loads(EXAMPLE.read_text())
    for point in body["points"]:
        for gauge in ("kv_cache_usage", "num_requests_waiting", "num_requests_running", "preemptions_per_s"):
            del point[gauge]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(body))
    args = parse("--capacity-curve", str(bare), "--duration", "1200", "--self-check-requests", "2000",
                 "--disable-tqdm")
    assert autoscale.run(args) == 0
    printed = capsys.readouterr().out
    assert "builtin-ttftP99" in printed
    assert "hpa-queue: not simulated: the curve carries no num_requests_waiting" in printed
    assert "builtin-kvCacheUsage: not simulated: the curve carries no kv_cache_usage" in printed


@pytest.mark.parametrize(("argv", "message"), [
    (["--capacity-curve", "missing.json"], "missing.json: No such file"),
    (["--slo-ttft-ms", "10"], "slo: even the curve's lowest rate (1 req/s) misses P99 TTFT 10 ms"),
    (["--trace", "__TMP__/bad.csv"], "bad.csv: point 1: time_s and rate must be numbers"),
    (["--self-check-requests", "500"], "(--self-check-requests): at least 2000"),
])
def test_bad_input_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                      message: str) -> None:
    (tmp_path / "bad.csv").write_text("time_s,rate\n0,1\nsoon,2\n")
    argv = [a.replace("__TMP__", str(tmp_path)) for a in argv]
    if "--capacity-curve" not in argv:
        argv = ["--capacity-curve", str(EXAMPLE), *argv]
    assert autoscale.run(parse(*argv, "--disable-tqdm")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvpilot bench autoscale: error: ") and message in err[0]


def test_bad_flags_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--capacity-curve", str(EXAMPLE), "--headroom", "1.5")
    assert "must be a number in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--capacity-curve", str(EXAMPLE), "--slo-goal", "101")
    assert "must be a number in (0, 100]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--capacity-curve", str(EXAMPLE), "--tolerance", "1")
    assert "must be a number in [0, 1)" in capsys.readouterr().err
