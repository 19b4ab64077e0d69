"""The distribution: every subpackage reaches the wheel, imports work from outside the repo,
no top-level `kernels`/`operator` package leaks, and the operator extra needs no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = {"runtime": "kvpilot.runtime", "kernels": "kvpilot.kernels", "operator": "kvpilot.operator"}


def source_packages() -> set[str]:
    """Every folder with an __init__.py under a component, as its import name."""
    names = set()
    for folder, import_name in COMPONENTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            names.add(".".join([import_name, *rel.parts]))
    return names


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-P", "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=600, cwd=out)
    assert built.returncode == 0, f"building the wheel failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    (path,) = out.glob("kvpilot-*.whl")
    return path


def test_wheel_contains_every_subpackage(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    missing = source_packages() - in_wheel
    assert not missing, f"subpackages missing from the wheel (add them to pyproject.toml): {sorted(missing)}"


def test_wheel_ships_the_model_presets(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).name for n in names if n.startswith("kvpilot/runtime/presets/")}
    assert shipped == {p.name for p in (ROOT / "runtime" / "presets").glob("*.json")}
    assert "llama-3-8b.json" in shipped


def test_wheel_ships_the_cpu_kernel_source(wheel: Path) -> None:
    """kernels/cpu_ops.py compiles it on first use, so an installed package needs the C file."""
    names = zipfile.ZipFile(wheel).namelist()
    assert {Path(n).name for n in names if n.startswith("kvpilot/kernels/csrc/")} == {
        p.name for p in (ROOT / "kernels" / "csrc").glob("*.c")}


def test_wheel_has_no_top_level_component_folders(wheel: Path) -> None:
    tops = {n.split("/", 1)[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert not tops & {"runtime", "kernels", "operator", "kvpilot/__init__.py"}
    assert "kvpilot" in tops


def test_operator_extra_does_not_require_torch(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    operator_reqs = [r for r in meta.get_all("Requires-Dist") or [] if "extra == \"operator\"" in r]
    assert operator_reqs, "the operator extra is missing"
    assert not [r for r in operator_reqs if r.startswith("torch")]


def test_components_import_from_outside_the_repo(tmp_path: Path) -> None:
    code = (
        "import kvpilot.runtime, kvpilot.kernels, kvpilot.operator, pathlib\n"
        "for m in (kvpilot.runtime, kvpilot.kernels, kvpilot.operator):\n"
        "    print(pathlib.Path(m.__file__).parent.name)\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["runtime", "kernels", "operator"]


def test_no_top_level_kernels_or_operator_package_is_installed(tmp_path: Path) -> None:
    code = (
        "import importlib.util, operator, sysconfig\n"
        "assert importlib.util.find_spec('runtime') is None, 'runtime'\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "assert spec is None or 'site-packages/kernels' in str(spec.origin), spec\n"
        "assert operator.__file__.startswith(sysconfig.get_paths()['stdlib']), operator.__file__\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr


def test_operator_and_cli_import_without_torch(tmp_path: Path) -> None:
    # `sys.modules['torch'] = None` makes any `import torch` raise ImportError.
    code = (
        "import sys, pkgutil, importlib\n"
        "sys.modules['torch'] = None\n"
        "import kvpilot.operator, kvpilot.runtime.cli\n"
        "for m in pkgutil.walk_packages(kvpilot.operator.__path__, 'kvpilot.operator.'):\n"
        "    importlib.import_module(m.name)\n"
        "kvpilot.runtime.cli.build_parser()\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr


def test_console_script_prints_help(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "kvpilot"
    result = subprocess.run([str(exe), "--help"], cwd=tmp_path, text=True, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "kvpilot" in result.stdout
