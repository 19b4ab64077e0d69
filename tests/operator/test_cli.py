from __future__ import annotations

import argparse

import pytest

from kvpilot.operator import cli


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_namespace_is_repeatable() -> None:
    assert _parse("--namespace", "a", "-n", "b").namespaces == ["a", "b"]


def test_namespace_and_all_namespaces_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        _parse("--namespace", "a", "--all-namespaces")


def test_run_refuses_without_a_namespace_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(_parse()) == 2
    assert "--all-namespaces" in capsys.readouterr().out


def test_defaults() -> None:
    args = _parse("-A")
    assert (args.metrics_port, args.health_port, args.peering, args.standalone) == (8080, 8081, None, False)


def test_registered_as_kvpilot_operator() -> None:
    from kvpilot.runtime.cli import SUBCOMMANDS

    assert SUBCOMMANDS["operator"][0] == "kvpilot.operator.cli"


@pytest.mark.parametrize(("flag", "value"), [("--workers", "0"), ("--resync-interval", "-1")])
def test_run_refuses_bad_numbers_naming_the_flag(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    assert cli.run(_parse("-A", flag, value)) == 2
    assert capsys.readouterr().out.startswith(f"kvpilot operator: {flag}: must be")


@pytest.mark.parametrize(("flags", "named"), [
    (["--prometheus-address", "prometheus:9090"], "--prometheus-address"),
    (["--engine-monitoring", "--engine-monitoring-interval", "soon"], "--engine-monitoring-interval"),
])
def test_run_refuses_bad_monitoring_and_keda_flags_naming_them(capsys: pytest.CaptureFixture[str],
                                                               flags: list[str], named: str) -> None:
    assert cli.run(_parse("-A", *flags)) == 2
    assert capsys.readouterr().out.startswith(f"kvpilot operator: {named}:")
