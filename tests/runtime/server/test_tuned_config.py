"""`kvpilot serve --tuned-config FILE`: a pod the operator tuned live starts with the tuned values
(the ConfigMap it keeps current), not with its flags'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.runtime.args import EngineArgs
from kvpilot.runtime.cli import build_parser

KVPILOT = str(Path(sys.executable).parent / "kvpilot")


def _args(*flags: str) -> EngineArgs:
    return EngineArgs.from_cli(build_parser().parse_args(["serve", *flags]))


def test_the_file_overrides_the_flags_it_names(tmp_path: Path) -> None:
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"block_size": 8, "preemption_mode": "swap", "max_num_seqs": 64}))
    tuned = _args("--block-size", "16", "--max-num-seqs", "256", "--swap-space", "2").with_tuned_config(str(path))
    assert (tuned.block_size, tuned.preemption_mode, tuned.max_num_seqs) == (8, "swap", 64)
    assert tuned.swap_space == 2  # not a tunable: the flag stands


def test_a_missing_or_empty_file_changes_nothing(tmp_path: Path) -> None:
    args = _args("--block-size", "32")
    assert args.with_tuned_config(str(tmp_path / "absent.json")) == args
    (tmp_path / "empty.json").write_text("")
    assert args.with_tuned_config(str(tmp_path / "empty.json")) == args


@pytest.mark.parametrize(("content", "problem"), [
    ("{not json", "is not JSON"),
    ("[8]", "must hold a JSON object"),
    ('{"swap_space": 4}', "swap_space: not a live tunable"),
    ('{"block_size": 12}', "block_size: must be one of 8, 16, 32, 64, not 12"),
    ('{"max_num_seqs": true}', "max_num_seqs: expected an integer from 1 to 65536, got True"),
])
def test_a_bad_file_is_refused_naming_the_flag(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "tuned.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=problem) as caught:
        _args().with_tuned_config(str(path))
    assert str(caught.value).startswith("tuned_config: ")


def test_serve_exits_2_with_one_line_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "tuned.json"
    path.write_text('{"block_size": 12}')
    result = subprocess.run([KVPILOT, "serve", "--tuned-config", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "--tuned-config" in lines[0], result.stderr
