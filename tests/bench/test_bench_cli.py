"""`kvpilot bench`: the four benchmarks behind one command, each imported only when chosen."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "PYTHONSAFEPATH": "1"}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)


def test_the_parser_builds_without_numpy_or_torch_and_bench_serve_parses_without_them() -> None:
    result = _python(
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "from kvpilot.runtime.cli import build_parser\n"
        "args = build_parser().parse_args(['bench', 'serve', '--num-prompts', '3', '--request-rate', '1', 'inf'])\n"
        "assert args.num_prompts == 3 and args.request_rate == [1.0, float('inf')], args\n"
        "assert 'kvpilot.bench.autoscale' not in sys.modules and 'kvpilot.bench.throughput' not in sys.modules\n")
    assert result.returncode == 0, result.stderr


def test_a_benchmark_whose_packages_are_missing_says_so_in_one_line() -> None:
    result = _python(
        "import sys; sys.modules['numpy'] = None\n"
        "from kvpilot.runtime.cli import main\n"
        "sys.exit(main(['bench', 'autoscale', '--capacity-curve', 'x.json']))\n")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kvpilot bench autoscale: error: import of numpy halted; None in sys.modules; install kvpilot[bench]"]


def test_bench_help_lists_the_four_benchmarks() -> None:
    result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvpilot"), "bench", "--help"],
                            capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == 0
    for name in ("serve", "throughput", "autoscale", "autotune"):
        assert f"    {name}" in result.stdout
