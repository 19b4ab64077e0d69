"""The CRD's properties for the live tunables, written from the contract (runtime/tunables.py).

The CRD file is hand-written except between marker comments: `# BEGIN tunables.spec ...` marks
spec.engine's tunables (type, rule, default, the flag's help), `# BEGIN tunables.status ...` the
tunables as status shows them (status.engine, status.tuning.config). `make crds` rewrites those
blocks in crds/ and in the chart's copy; tests/operator/test_crd_schema.py fails while a file
differs from what this module writes.

    python -m kvpilot.operator.crd_schema [--check] [FILE ...]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from kvpilot.runtime.tunables import TUNABLES, Tunable

CRD_FILES = ("crds/inferenceservices.serving.kvpilot.io.yaml",
             "charts/kvpilot/crds/inferenceservices.serving.kvpilot.io.yaml")
COMMAND = "make crds"
_BEGIN = re.compile(r"^( *)# BEGIN (tunables\.\w+):")
_TYPES = {int: "integer", str: "string"}


def spec_property(t: Tunable) -> dict[str, Any]:
    """spec.engine's field: the flag's words, the contract's rule and default."""
    description = f"{t.flag}, {t.help}. {t.rule[:1].upper()}{t.rule[1:]}."
    prop: dict[str, Any] = {"type": _TYPES[t.kind], "description": description}
    if t.choices is not None:
        prop["enum"] = list(t.choices)
    if t.minimum is not None:
        prop["minimum"] = t.minimum
    if t.maximum is not None:
        prop["maximum"] = t.maximum
    if t.default is not None:
        prop["description"] += f" Default {t.default}."
        prop["default"] = t.default
    return prop


def status_property(t: Tunable) -> dict[str, Any]:
    """A status field that reports the tunable (what the operator writes, never checked)."""
    return {"type": _TYPES[t.kind], "description": f"{t.title}."}


BLOCKS: dict[str, Callable[[Tunable], dict[str, Any]]] = {
    "tunables.spec": spec_property,
    "tunables.status": status_property,
}


class _Dumper(yaml.SafeDumper):
    """Block mappings, flow lists (`enum: [8, 16]`): the hand-written rest of the file's style."""


_Dumper.add_representer(list, lambda dumper, data: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", data, flow_style=True))


def _block(kind: str, indent: str) -> str:
    properties = {t.camel: BLOCKS[kind](t) for t in TUNABLES}
    text = yaml.dump(properties, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=float("inf"))
    return "".join(indent + line for line in text.splitlines(keepends=True))


def render(text: str) -> str:
    """`text` (a CRD file) with every marked block written from the contract."""
    out: list[str] = []
    lines = iter(text.splitlines(keepends=True))
    for line in lines:
        out.append(line)
        begin = _BEGIN.match(line)
        if begin is None:
            continue
        indent, kind = begin.groups()
        if kind not in BLOCKS:
            raise ValueError(f"{line.strip()}: unknown block (known: {', '.join(BLOCKS)})")
        end = f"{indent}# END {kind}\n"
        for old in lines:  # the block as it stands, up to its end marker
            if old == end:
                break
        else:
            raise ValueError(f"{line.strip()}: no `{end.strip()}` line after it")
        out += [_block(kind, indent), end]
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.operator.crd_schema", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    parser.add_argument("files", nargs="*", default=list(CRD_FILES), help="CRD files (default: %(default)s)")
    args = parser.parse_args(argv)
    stale = []
    for name in args.files:
        path = Path(name)
        text = path.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            stale.append(name)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"out of date with runtime/tunables.py: {', '.join(stale)}; run `{COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
