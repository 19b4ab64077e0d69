"""The CRD's properties for the live tunables are written from the contract (`make crds`): the
committed files are what the generator writes, and it rewrites only its marked blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvpilot.operator.crd_schema import COMMAND, CRD_FILES, main, render
from kvpilot.runtime.tunables import TUNABLES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", CRD_FILES)
def test_the_committed_crd_is_what_the_contract_writes(name: str) -> None:
    text = (ROOT / name).read_text(encoding="utf-8")
    assert render(text) == text, f"{name} is out of date with runtime/tunables.py: run `{COMMAND}`"


def test_each_block_gets_every_tunable_and_the_rest_of_the_file_is_kept() -> None:
    text = ("a:  # kept as written\n"
            "  properties:\n"
            "    # BEGIN tunables.status: generated\n"
            "    stale: {}\n"
            "    # END tunables.status\n"
            "    other: {type: string}\n")
    written = render(text)
    assert written.startswith("a:  # kept as written\n") and written.endswith("    other: {type: string}\n")
    properties = yaml.safe_load(written)["a"]["properties"]
    assert list(properties) == [t.camel for t in TUNABLES] + ["other"]
    assert render(written) == written


def test_a_block_without_its_end_line_is_refused() -> None:
    with pytest.raises(ValueError, match="no `# END tunables.spec` line"):
        render("p:\n  # BEGIN tunables.spec: generated\n  blockSize: {}\n")


def test_check_names_the_stale_file_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text("p:\n  # BEGIN tunables.status: x\n  # END tunables.status\n", encoding="utf-8")
    assert main(["--check", str(stale)]) == 1
    err = capsys.readouterr().err
    assert str(stale) in err and COMMAND in err
    assert main([str(stale)]) == 0  # written
    assert main(["--check", str(stale)]) == 0
    assert "blockSize" in stale.read_text(encoding="utf-8")
