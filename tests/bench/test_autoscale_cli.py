"""`kvpilot bench autoscale` end to end through its add_arguments/run: short days written as JSON
and PNG, settings chosen on some days and judged on others, the comparisons, and one clear error
line for bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpilot.bench import autoscale

EXAMPLE = Path(__file__).parent / "data" / "example-capacity-curve.json"
SHORT = ("--capacity-curve", str(EXAMPLE), "--duration", "1200", "--peak-rate", "40", "--self-check-requests", "2000",
         "--disable-tqdm")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpilot bench autoscale")
    autoscale.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_days_chosen_on_and_judged_on_write_json_a_png_and_the_comparisons(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "autoscale.json"
    args = parse(*SHORT, "--signals", "kvCacheUsage", "--headroom", "0.8", "0.6", "--tolerance", "0.05",
                 "--forecast-horizon", "auto", "60", "--startup-delay", "45", "--seed", "3", "4", "--choose-on", "0",
                 "--jobs", "2", "--output", str(out))
    assert autoscale.run(args) == 0
    body = json.loads(out.read_text())
    judged = {f["name"]: f for f in body["judged"]["fleets"]}
    families = {f["family"] for f in judged.values()}
    assert families == {"static-peak", "reactive-bound", "clairvoyant"} | {
        f"{mode}:kvCacheUsage" for mode in ("builtin", "builtin-reactive", "hpa", "keda")}
    # every mode on every setting: 2 headrooms (x 2 horizons for builtin)
    assert sum(f["family"] == "builtin:kvCacheUsage" for f in judged.values()) == 4
    assert sum(f["family"] == "hpa:kvCacheUsage" for f in judged.values()) == 2
    assert "builtin:kvCacheUsage h0.6 t0.05 z60" in judged and "builtin:kvCacheUsage h0.6 t0.05 z=start-up+interval" \
        in judged
    static = judged["static-peak"]
    assert static["cost"] == 1.0 and static["num_scale_events"] == 0
    # the same requests for every fleet of a day, and the judged days pooled
    assert len({f["num_requests"] for f in judged.values()}) == 1
    assert body["judged"]["seeds"] == [3, 4] and body["chosen_on"]["seeds"] == [0]
    assert set(body["days"]) == {"0", "3", "4"} and body["days"]["3"]["peak"] != body["days"]["4"]["peak"]
    # each family's choice is its cheapest setting meeting the goal on the days it was chosen on
    chosen_on = {f["name"]: f for f in body["chosen_on"]["fleets"]}
    for family, name in body["choice"].items():
        settings = [f for f in chosen_on.values() if f["family"] == family]
        meeting = [f for f in settings if f["attainment"] >= body["slo_goal"]]
        expected = min(meeting, key=lambda f: f["cost"]) if meeting else max(settings, key=lambda f: f["attainment"])
        assert chosen_on[name] == expected, family
    kinds = {(c["kind"], c.get("theirs")) for c in body["comparisons"]}
    assert ("frontier", "hpa:kvCacheUsage") in kinds and ("frontier", "keda:kvCacheUsage") in kinds
    assert ("prediction", None) in kinds
    assert body["config"]["startup_s"] == 45 and body["config"]["cluster"]["adapter_window_s"] == 60
    assert body["self_check"]["passed"] and body["curve"]["short_runs"] is None
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "self-check passed" in printed and "judged on days 3, 4" in printed
    assert "builtin:kvCacheUsage frontier vs hpa:kvCacheUsage:" in printed
    assert f"wrote {out}" in printed


def test_the_yardsticks_bound_what_knowing_the_load_buys(tmp_path: Path) -> None:
    out = tmp_path / "autoscale.json"
    assert autoscale.run(parse(*SHORT, "--modes", "builtin", "--signals", "kvCacheUsage", "--output", str(out))) == 0
    judged = {f["family"]: f for f in json.loads(out.read_text())["judged"]["fleets"]}
    assert judged["clairvoyant"]["attainment"] >= judged["reactive-bound"]["attainment"]
    assert set(judged) == {"static-peak", "builtin:kvCacheUsage", "reactive-bound", "clairvoyant"}


def test_a_curve_of_short_runs_is_said_to_be_short(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = json.loads(EXAMPLE.read_text())
    for point in body["points"]:
        point |= {"num_requests": 300, "duration_s": 300 / point["request_rate"] + 2.0}
    short = tmp_path / "short.json"
    short.write_text(json.dumps(body))
    argv = [a if a != str(EXAMPLE) else str(short) for a in SHORT]
    autoscale.run(parse(*argv, "--modes", "builtin", "--signals", "kvCacheUsage"))
    assert "the curve's runs hold 300-300 requests a rate, fewer than the 1,000 of a sustained run" in \
        capsys.readouterr().out


def test_a_written_trace_replays_the_built_in_day_exactly(tmp_path: Path) -> None:
    common = (*SHORT, "--modes", "hpa", "--signals", "waitingPerReplica")
    trace = tmp_path / "day.csv"
    assert autoscale.run(parse(*common, "--write-trace", str(trace), "--output", str(tmp_path / "built-in.json"))) == 0
    assert trace.read_text().startswith("time_s,rate\n0.0,")
    file_args = [a for a in common if a not in ("--duration", "1200", "--peak-rate", "40")]
    assert autoscale.run(parse(*file_args, "--trace", str(trace), "--output", str(tmp_path / "file.json"))) == 0
    built_in, replayed = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("built-in", "file"))
    assert replayed["judged"]["fleets"] == built_in["judged"]["fleets"]


def test_a_curve_without_gauges_compares_what_it_can(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = json.loads(EXAMPLE.read_text())
    for point in body["points"]:
        for gauge in ("kv_cache_usage", "num_requests_waiting", "num_requests_running", "preemptions_per_s"):
            del point[gauge]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(body))
    out = tmp_path / "bare-results.json"
    argv = [a if a != str(EXAMPLE) else str(bare) for a in SHORT]
    assert autoscale.run(parse(*argv, "--signals", "kvCacheUsage", "ttftP99", "--output", str(out))) == 0
    families = {f["family"] for f in json.loads(out.read_text())["judged"]["fleets"]}
    assert {"builtin:ttftP99", "builtin-reactive:ttftP99"} <= families and "hpa:ttftP99" not in families
    assert "hpa:kvCacheUsage" not in families


@pytest.mark.parametrize(("argv", "message"), [
    (["--capacity-curve", "missing.json"], "missing.json: No such file"),
    (["--slo-ttft-ms", "10"], "slo: even the curve's lowest rate (1 req/s) misses P99 TTFT 10 ms"),
    (["--trace", "__TMP__/bad.csv"], "bad.csv: point 1: time_s and rate must be numbers"),
    (["--self-check-requests", "500"], "(--self-check-requests): at least 2000"),
    (["--pending", "200"], "pending_s: must lie in [0, startup_s = 120]"),
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
    for flag, value, message in (("--headroom", "1.5", "must be a number in (0, 1]"),
                                 ("--slo-goal", "101", "must be a number in (0, 100]"),
                                 ("--tolerance", "1", "must be a number in [0, 1)"), ("--forecast-horizon", "soon", "soon"),
                                 ("--modes", "vpa", "invalid choice"),
                                 ("--jobs", "0", "argument --jobs: must be a positive integer, not '0'"),
                                 ("--max-replicas", "0", "argument --max-replicas: must be a positive integer"),
                                 ("--bursts", "-1", "argument --bursts: must be a non-negative integer")):
        with pytest.raises(SystemExit):
            parse("--capacity-curve", str(EXAMPLE), flag, value)
        assert message in capsys.readouterr().err
