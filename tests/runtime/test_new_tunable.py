"""A new live tunable takes two edits, as runtime/tunables.py's docstring says: its entry in the
contract and its holder in the engine (a `SchedulerConfig` field). Everything else follows: the
flag, the `LLM(...)` keyword, the engine's config, the core's snapshot, the metrics label,
`POST /admin/config`'s check, the operator's spec field, the pods' flag, status.engine and the
CRD's properties (written by `make crds`).

The test makes those two edits to a copy of the sources and runs the checks in a child process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE = '''MAX_NUM_FAKES = Tunable("max_num_fakes", "maxNumFakes", int, minimum=1, maximum=8, default=4,
                        help="fakes in one step", title="Fakes in one step")
'''
# the contract's edits: the Tunable, its place in TUNABLES, the LiveConfig and TunableArgs fields
# (both follow the scheduler policy's line), the table row
CONTRACT_EDITS = [
    (r"\nTUNABLES: tuple\[Tunable, \.\.\.\] = \(", "\n" + FAKE + r"\g<0>"),
    (r"(\nTUNABLES: tuple\[Tunable, \.\.\.\] = \([^)]*)\)", r"\1, MAX_NUM_FAKES)"),
    (r"\n    scheduler_policy: str = SCHEDULER_POLICY\.default\n",
     r"\g<0>    max_num_fakes: int = MAX_NUM_FAKES.default\n"),
    (r"\n\| `scheduler_policy` [^\n]*\n",
     r"\g<0>| `max_num_fakes` | `--max-num-fakes` | `maxNumFakes` | 1 to 8 | 4 |\n"),
]
# the engine's holder: a SchedulerConfig field of the same name, listed in SCHEDULER_TUNABLES
HOLDER_EDITS = [
    (r"\nSCHEDULER_TUNABLES = \([^)]*", r"\g<0>, MAX_NUM_FAKES"),
    (r"\n    scheduler_policy: str = SCHEDULER_POLICY\.default\n",
     r"\g<0>    max_num_fakes: int = MAX_NUM_FAKES.default\n"),
    (r"\nfrom kvpilot\.runtime\.tunables import \(\n", r"\g<0>    MAX_NUM_FAKES,\n"),
]

CHECKS = textwrap.dedent('''
    import dataclasses, sys
    import msgspec, yaml
    from kvpilot.operator.crd_schema import CRD_FILES, render
    from kvpilot.operator.engine_args import serve_args
    from kvpilot.operator.manifests import Owner, engine_config
    from kvpilot.operator.model_source import resolve_model_source
    from kvpilot.operator.spec import EngineSpec, InferenceServiceSpec
    from kvpilot.runtime.args import EngineArgs
    from kvpilot.runtime.cli import build_parser
    from kvpilot.runtime.engine.messages import EngineSnapshot
    from kvpilot.runtime.server.metrics import ServerMetrics
    from kvpilot.runtime.tunables import LiveConfig, check_changes

    serve = lambda argv: build_parser().parse_args(["serve", *argv])
    assert serve([]).max_num_fakes == 4 and serve(["--max-num-fakes", "3"]).max_num_fakes == 3
    try:
        serve(["--max-num-fakes", "9"])
        raise AssertionError("--max-num-fakes 9 was taken")
    except SystemExit:
        pass
    args = EngineArgs.from_kwargs(None, {"max_num_fakes": 2, "device": "cpu"})  # LLM(max_num_fakes=2)
    config = args.create_engine_config()
    assert config.scheduler.max_num_fakes == 2 and config.tunables.max_num_fakes == 2
    assert check_changes({"max_num_fakes": 3}) == {"max_num_fakes": 3}  # POST /admin/config
    wire = msgspec.msgpack.encode(EngineSnapshot(num_blocks=1, live=config.tunables))
    snapshot = msgspec.msgpack.decode(wire, type=EngineSnapshot)
    assert snapshot.live.max_num_fakes == 2
    metrics = ServerMetrics("m")
    metrics.record([], snapshot, None)
    assert 'max_num_fakes="2"' in metrics.expose().decode()

    spec = InferenceServiceSpec.model_validate({"model": {"source": "embedded"}, "engine": {"maxNumFakes": 5}})
    assert spec.engine.max_num_fakes == 5 and EngineSpec().max_num_fakes == 4
    argv = serve_args(spec, resolve_model_source("embedded"), "m")
    assert serve(argv).max_num_fakes == 5
    assert engine_config(Owner("m", "ns", "uid"), spec, resolve_model_source("embedded"))["maxNumFakes"] == 5
    assert LiveConfig.from_status(config.tunables.to_status()) == config.tunables

    text = open(CRD_FILES[0], encoding="utf-8").read()
    assert render(text) != text, "the committed CRD lacks the new tunable until `make crds`"
    schema = yaml.safe_load(render(text))["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    field = schema["spec"]["properties"]["engine"]["properties"]["maxNumFakes"]
    assert {k: field[k] for k in ("type", "minimum", "maximum", "default")} == {
        "type": "integer", "minimum": 1, "maximum": 8, "default": 4}, field
    assert "--max-num-fakes" in field["description"]
    status = schema["status"]["properties"]
    assert status["engine"]["properties"]["maxNumFakes"]["type"] == "integer"
    assert status["tuning"]["properties"]["config"]["properties"]["maxNumFakes"]["type"] == "integer"
    print("ok")
''')


def _edit(path: Path, edits: list[tuple[str, str]]) -> None:
    text = path.read_text(encoding="utf-8")
    for pattern, replacement in edits:
        text, count = re.subn(pattern, replacement, text)
        assert count, f"{path.name}: no {pattern!r} to edit (has the file changed shape? update this test)"
    path.write_text(text, encoding="utf-8")


def _copy(source: Path, target: Path, edited: set[str]) -> None:
    """`source` as links, except the files named in `edited` (relative paths), which are copied."""
    target.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name == "__pycache__":
            continue
        inside = {e.split("/", 1)[1] for e in edited if e.startswith(entry.name + "/")}
        if entry.is_dir() and inside:
            _copy(entry, target / entry.name, inside)
        elif entry.name in edited:
            (target / entry.name).write_bytes(entry.read_bytes())
        else:
            (target / entry.name).symlink_to(entry)


def test_a_new_tunable_is_its_contract_entry_and_its_engine_holder(tmp_path: Path) -> None:
    packages = tmp_path / "packages" / "kvpilot"
    _copy(ROOT / "runtime", packages / "runtime", {"tunables.py", "config.py"})
    for package in ("operator", "kernels", "bench"):
        (packages / package).symlink_to(ROOT / package)
    _edit(packages / "runtime" / "tunables.py", CONTRACT_EDITS)
    _edit(packages / "runtime" / "config.py", HOLDER_EDITS)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "packages"), "PYTHONSAFEPATH": "1"}
    child = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=240)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr[-3000:]
