"""The import graph, computed from the sources, follows the architecture: no cycle, and no arrow
from a lower layer to a higher one.

`LAYERS` is the architecture, lowest first; a module may import its own layer and the layers
below it. Every module of the four packages must sit in exactly one row, so a new module is
placed on purpose. Imports inside functions run and are counted everywhere. Imports under
`if TYPE_CHECKING:` do not run: an arrow of theirs may point up a layer (an annotation names a
type of a higher layer), but they still count as coupling, so no cycle may go through them either.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"kvpilot.kernels": "kernels", "kvpilot.runtime": "runtime", "kvpilot.operator": "operator",
            "kvpilot.bench": "bench"}

# (layer, module prefixes it holds, layers it may import besides its own and those listed before it)
RUNTIME_LAYERS: list[tuple[str, list[str]]] = [
    # the live tunables, spelled once: the runtime and the operator both import it
    ("tunables contract", ["kvpilot.runtime.tunables"]),
    ("kernels", ["kvpilot.kernels"]),
    ("runtime base", ["kvpilot.runtime.config", "kvpilot.runtime.arg_types", "kvpilot.runtime.args",
                      "kvpilot.runtime.sampling_params",
                      "kvpilot.runtime.outputs", "kvpilot.runtime.model_source", "kvpilot.runtime.errors",
                      "kvpilot.runtime.tokenizer", "kvpilot.runtime.quantization", "kvpilot.runtime.startup",
                      "kvpilot.runtime.cuda_probe", "kvpilot.runtime.caches"]),
    # tensors: the engine core process (and tensor-parallel workers); the runner knows no Sequence
    ("executor", ["kvpilot.runtime.executor"]),
    # the engine's bookkeeping, torch-free
    ("sched", ["kvpilot.runtime.sched"]),
    # the engine core process of `kvpilot serve` (LLM's own process offline): the step and the busy loop
    ("engine", ["kvpilot.runtime.engine"]),
    # the API process of `kvpilot serve`: HTTP, AsyncEngine (the core's client), output processing
    ("server", ["kvpilot.runtime.server"]),
    ("front doors", ["kvpilot.runtime", "kvpilot.runtime.llm", "kvpilot.runtime.cli", "kvpilot.runtime.generate_cli"]),
]
# Products beside the runtime, with everything of kvpilot's they may import (besides themselves).
SEPARATE: dict[str, tuple[list[str], set[str]]] = {
    # runs without torch, in its own image; of the runtime it reads only the tunables' contract
    "operator": (["kvpilot.operator"], {"tunables contract"}),
    # fleet simulations drive the operator's policies; `bench throughput` runs the offline engine and
    # `bench autotune` starts `kvpilot serve` with the runtime's own flag parser
    "bench": (["kvpilot.bench"], {"operator", "tunables contract", "runtime base", "front doors"}),
}
# Third-party packages a layer never imports (directly), and why.
FORBIDDEN = {
    "operator": {"torch", "triton", "transformers"},  # the operator image has none of them
    # torch only in `bench throughput` (its copy-rate probe) and `bench startup` (writing a checkpoint)
    "bench": {"triton", "transformers"},
    "kernels": {"transformers"},
    "tunables contract": {"torch", "triton", "transformers", "pydantic", "numpy"},  # plain Python
}
# Modules that must stay torch-free (their tests run with torch blocked).
TORCH_FREE = ["kvpilot.runtime.sched.scheduler", "kvpilot.runtime.sched.block_manager",
              "kvpilot.runtime.sched.sequence", "kvpilot.runtime.engine.step_inputs",
              "kvpilot.runtime.sched.policies", "kvpilot.runtime.sched.host_blocks",
              "kvpilot.runtime.sched.relayout", "kvpilot.runtime.engine.warm_up",
              "kvpilot.runtime.executor.inputs", "kvpilot.runtime.cli", "kvpilot.runtime.quantization",
              "kvpilot.runtime.executor.checkpoint_files"]

LAYER_ORDER = [name for name, _ in RUNTIME_LAYERS]


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: set[str] | frozenset[str] = frozenset(),
               type_checking: bool = False) -> set[str]:
    """Every module name `module` imports when it runs (absolute, relative resolved), and with
    `type_checking` those under `if TYPE_CHECKING:` too; `known` tells `from package import
    module` from `from module import name`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from package import module` imports the module
                name = f"{source}.{alias.name}"
                found.add(name if name in known else source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def layer_of(module: str) -> str:
    rows = [(name, prefix) for name, prefixes in RUNTIME_LAYERS for prefix in prefixes]
    rows += [(name, prefix) for name, (prefixes, _) in SEPARATE.items() for prefix in prefixes]
    exact = [name for name, prefix in rows if module == prefix]
    if exact:
        return exact[0]
    # the longest prefix wins; "kvpilot.runtime" itself holds only the package's front door
    matches = sorted(((len(p), name) for name, p in rows if module.startswith(p + ".") and p != "kvpilot.runtime"),
                     reverse=True)
    if not matches:
        raise LookupError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return matches[0][1]


def graph(type_checking: bool = False) -> dict[str, set[str]]:
    files = module_files()
    return {m: {t for t in imports_of(m, p, set(files), type_checking) if t in files and t != m}
            for m, p in files.items()}


def may_import(importer: str, imported: str) -> bool:
    if importer == imported:
        return True
    if importer in SEPARATE:
        return imported in SEPARATE[importer][1]
    if imported in SEPARATE:
        return False
    return LAYER_ORDER.index(imported) <= LAYER_ORDER.index(importer)


def test_every_module_sits_in_one_layer() -> None:
    unplaced = []
    for module in module_files():
        try:
            layer_of(module)
        except LookupError as e:
            unplaced.append(str(e))
    assert not unplaced


def test_no_arrow_goes_up_a_layer() -> None:
    back_edges = [f"{a} ({layer_of(a)}) -> {b} ({layer_of(b)})"
                  for a, targets in graph().items() for b in sorted(targets)
                  if not may_import(layer_of(a), layer_of(b))]
    assert not back_edges


def test_no_import_cycle_even_through_deferred_or_type_only_imports() -> None:
    edges = graph(type_checking=True)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not [" -> ".join(c) for c in cycles]


def test_forbidden_third_party_imports() -> None:
    bad = []
    for module, path in module_files().items():
        banned = FORBIDDEN.get(layer_of(module), set())
        if module in TORCH_FREE:
            banned = banned | {"torch"}
        roots = {name.split(".")[0] for name in imports_of(module, path)}
        bad += [f"{module} imports {name}" for name in sorted(roots & banned)]
    assert not bad


@pytest.mark.parametrize("importer,imported,allowed", [
    ("kvpilot.runtime.engine.engine", "kvpilot.runtime.executor.model_runner", True),
    ("kvpilot.runtime.executor.model_runner", "kvpilot.runtime.sched.scheduler", False),
    ("kvpilot.runtime.sched.scheduler", "kvpilot.runtime.engine.engine", False),
    ("kvpilot.runtime.engine.core", "kvpilot.runtime.server.async_engine", False),
    ("kvpilot.kernels.ops", "kvpilot.runtime.config", False),
    ("kvpilot.runtime.server.app", "kvpilot.runtime.llm", False),
    ("kvpilot.operator.reconcile", "kvpilot.runtime.config", False),
    ("kvpilot.operator.spec", "kvpilot.runtime.tunables", True),
    ("kvpilot.runtime.tunables", "kvpilot.runtime.config", False),
    ("kvpilot.bench.fleet", "kvpilot.operator.autoscale", True),
    ("kvpilot.runtime.llm", "kvpilot.runtime.engine.engine", True),
])
def test_the_table_decides_as_the_architecture_says(importer: str, imported: str, allowed: bool) -> None:
    assert may_import(layer_of(importer), layer_of(imported)) is allowed


def test_relative_and_lazy_imports_are_seen(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom . import sibling\nfrom .models import llama\n"
                      "if TYPE_CHECKING:\n    from kvpilot.runtime.server import app\n"
                      "def f():\n    import kvpilot.runtime.engine.engine\n")
    found = imports_of("kvpilot.runtime.executor.mod", source, {"kvpilot.runtime.executor.sibling"})
    assert {"kvpilot.runtime.executor.sibling", "kvpilot.runtime.executor.models",
            "kvpilot.runtime.engine.engine"} <= found
    assert "kvpilot.runtime.server.app" not in found
    assert "kvpilot.runtime.server.app" in imports_of("kvpilot.runtime.executor.mod", source,
                                                      {"kvpilot.runtime.server.app"}, type_checking=True)


def test_the_api_process_loads_no_torch() -> None:
    """`kvpilot serve`'s API process (HTTP, tokenising, detokenising) imports the server app; only
    the engine core, in its own process, needs torch."""
    code = "import sys, kvpilot.runtime.server.app; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
