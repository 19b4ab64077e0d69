"""The container images, checked without a Docker daemon: every Dockerfile instruction parses
with BuildKit's own parser, bases are pinned in a form a digest can be added to, the final stage
runs as a non-root uid and keeps no build tools, the entrypoints are the CLI's real subcommands,
the build context holds what the COPYs need, and the operator image's install step succeeds in
a fresh venv where torch is absent."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import dockerfile
import pytest
import yaml

from kvpilot.operator.cli import DEFAULT_IMAGE
from kvpilot.operator.engine_args import SERVE_PORT
from kvpilot.runtime.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {"runtime": ROOT / "docker" / "runtime.Dockerfile", "operator": ROOT / "docker" / "operator.Dockerfile"}
# Dockerfile reference: every instruction BuildKit knows
INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}
BUILD_TOOLS = {"build-essential", "g++", "make", "cmake", "git", "python3-dev", "python3-pip", "python3-venv",
               "curl", "wget", "pkg-config"}
# Triton compiles each kernel's CUDA launcher with the system C compiler at first launch.
FINAL_PACKAGES = {"runtime": {"python3", "gcc", "libc6-dev", "libpython3-dev"}, "operator": set()}
PODS_UID = 1000  # runAsUser of the operator's pods (chart) and of the serving pods (operator)
# docker's reference grammar, enough for name:tag@digest
REFERENCE = re.compile(r"^(?:[a-z0-9.-]+(?::\d+)?/)?[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
                       r":[\w][\w.-]{0,127}(?:@sha256:[0-9a-f]{64})?$")
Command = dockerfile.Command


def parse(kind: str) -> tuple[Command, ...]:
    return dockerfile.parse_file(str(IMAGES[kind]))


def stages(commands: tuple[Command, ...]) -> list[list[Command]]:
    found: list[list[Command]] = []
    for command in commands:
        if command.cmd == "FROM":
            found.append([])
        if found:
            found[-1].append(command)
    return found


def base_args(commands: tuple[Command, ...]) -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults."""
    args: dict[str, str] = {}
    for command in commands:
        if command.cmd == "FROM":
            break
        if command.cmd == "ARG":
            name, _, default = command.value[0].partition("=")
            args[name] = default
    return args


def unknown_instructions(commands: tuple[Command, ...]) -> list[str]:
    return [f"line {c.start_line}: {c.cmd}" for c in commands if c.cmd not in INSTRUCTIONS]


def apt_packages(stage: list[Command]) -> set[str]:
    packages: set[str] = set()
    for command in stage:
        if command.cmd == "RUN":
            for install in re.findall(r"apt-get install ([^&;]+)", command.value[0]):
                packages |= {w for w in install.split() if not w.startswith("-")}
    return packages


def run_text(stage: list[Command]) -> str:
    return "\n".join(c.value[0] for c in stage if c.cmd == "RUN")


@pytest.mark.parametrize("kind", IMAGES)
def test_every_instruction_parses_and_is_known(kind: str) -> None:
    commands = parse(kind)
    assert commands and unknown_instructions(commands) == []
    assert all(c.value and all(v.strip() for v in c.value) for c in commands), "an instruction without arguments"


def test_the_instruction_check_can_fail() -> None:
    assert unknown_instructions(dockerfile.parse_string("FROM x\nRUNN make\n")) == ["line 2: RUNN"]


@pytest.mark.parametrize("kind", IMAGES)
def test_multi_stage_final_stage_takes_only_the_built_venv(kind: str) -> None:
    build, final = stages(parse(kind))
    assert build[0].value[-2:] == ("AS", "build")
    copies = [c for c in final if c.cmd in ("COPY", "ADD")]
    assert [(c.flags, c.value) for c in copies] == [(("--from=build",), ("/opt/kvpilot", "/opt/kvpilot"))]
    # the installer stays behind in the build stage
    assert "pip uninstall --yes pip" in run_text(build)


@pytest.mark.parametrize("kind", IMAGES)
def test_bases_are_pinned_by_tag_and_ready_for_a_digest(kind: str) -> None:
    commands = parse(kind)
    args = base_args(commands)
    for stage in stages(commands):
        match = re.fullmatch(r"\$\{(\w+)\}", stage[0].value[0])
        assert match, f"FROM {stage[0].value[0]}: name the base through an ARG, so a release can pin its digest"
        image = args[match[1]]
        name, _, tag = image.rpartition(":")
        assert "." in name.split("/")[0], f"{image}: name the registry"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{image}: pin a full version, not a moving tag"
        assert REFERENCE.match(f"{image}@sha256:{'0' * 64}"), f"{image}: a digest cannot be appended"


@pytest.mark.parametrize("kind", IMAGES)
def test_final_stage_runs_as_the_pods_non_root_uid(kind: str) -> None:
    final = stages(parse(kind))[-1]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users, "no USER in the final stage: it would run as root"
    # numeric, so that the kubelet can check runAsNonRoot without reading /etc/passwd
    uid, _, gid = users[-1].partition(":")
    assert (uid, gid) == (str(PODS_UID), str(PODS_UID))


@pytest.mark.parametrize("kind", IMAGES)
def test_final_stage_keeps_no_build_tools(kind: str) -> None:
    build, final = stages(parse(kind))
    assert apt_packages(final) == FINAL_PACKAGES[kind]
    text = run_text(final)
    assert not {tool for tool in BUILD_TOOLS if re.search(rf"(^|\s){re.escape(tool)}(\s|$)", text)}
    for stage in (build, final):
        for command in stage:
            if command.cmd == "RUN" and "apt-get install" in command.value[0]:
                assert "--no-install-recommends" in command.value[0]
                assert "rm -rf /var/lib/apt/lists/*" in command.value[0], "apt lists left in a layer"


@pytest.mark.parametrize("kind", IMAGES)
def test_installs_its_own_extra(kind: str) -> None:
    build = stages(parse(kind))[0]
    assert re.search(rf'pip install "\.\[{kind}\]"', run_text(build))
    if kind == "operator":
        assert "torch" not in run_text(build) and "[runtime]" not in run_text(build)


@pytest.mark.parametrize(("kind", "subcommand"), [("runtime", "serve"), ("operator", "operator")])
def test_entrypoint_runs_a_real_subcommand(kind: str, subcommand: str) -> None:
    final = stages(parse(kind))[-1]
    entrypoint, = [c for c in final if c.cmd == "ENTRYPOINT"]
    cmd, = [c for c in final if c.cmd == "CMD"]
    assert entrypoint.json and entrypoint.value == ("kvpilot",)  # exec form: signals reach kvpilot
    assert cmd.json
    args = build_parser().parse_args(list(cmd.value))  # a bad subcommand or flag exits here
    assert args.command == subcommand


def test_exposed_ports_are_the_ones_served() -> None:
    def exposed(kind: str) -> set[int]:
        return {int(p) for c in stages(parse(kind))[-1] if c.cmd == "EXPOSE" for p in c.value}

    assert exposed("runtime") == {SERVE_PORT}
    values = yaml.safe_load((ROOT / "charts" / "kvpilot" / "values.yaml").read_text())
    assert exposed("operator") == {values["metrics"]["port"], values["health"]["port"]}


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if any(fnmatch(c, pattern) or (pattern.startswith("**/") and fnmatch(c.split("/")[-1], pattern[3:]))
               for c in candidates):
            ignored = not negated
    return ignored


def test_build_context_holds_what_the_copies_need_and_nothing_else() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for kind in IMAGES:
        for command in parse(kind):
            if command.cmd == "COPY" and not command.flags:
                for source in command.value[:-1]:
                    assert (ROOT / source).exists() and not _ignored(source, patterns), f"{kind}: COPY {source}"
    for kept_out in (".venv/bin/python", ".git/config", "tests/conftest.py", "charts/kvpilot/values.yaml",
                     "runtime/__pycache__/cli.cpython-311.pyc"):
        assert _ignored(kept_out, patterns), kept_out


def test_chart_operator_and_make_name_these_images() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "kvpilot" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "kvpilot" / "values.yaml").read_text())
    runtime_image = f"ghcr.io/kvpilot/kvpilot-runtime:{chart['appVersion']}"
    assert values["runtimeImage"] == DEFAULT_IMAGE == runtime_image
    assert values["image"]["repository"] == "ghcr.io/kvpilot/kvpilot-operator"
    make = subprocess.run(["make", "-n", "images"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert make.returncode == 0, make.stderr
    builds = {tuple(shlex.split(line)[3:6]) for line in make.stdout.splitlines() if line.startswith("docker build")}
    assert builds == {("docker/runtime.Dockerfile", "-t", runtime_image),
                      ("docker/operator.Dockerfile", "-t", f"ghcr.io/kvpilot/kvpilot-operator:{chart['appVersion']}")}


@pytest.mark.slow
def test_operator_image_install_works_without_torch(tmp_path: Path) -> None:
    """The operator image's build stage, replayed outside Docker: its COPYs into a fresh folder,
    its pip RUN into a fresh venv (dependencies resolved from scratch, pip's download cache
    reused), then the CLI the image runs."""
    build = stages(parse("operator"))[0]
    context = tmp_path / "src"
    context.mkdir()
    for command in build:
        if command.cmd == "COPY":
            *sources, target = command.value
            for source in sources:
                destination = context / target / Path(source).name if target.endswith("/") else context / target
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, destination, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(ROOT / source, destination)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install, = [c.value[0] for c in build if c.cmd == "RUN" and "pip install" in c.value[0]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_NO_CACHE"))}
    result = subprocess.run(["bash", "-c", install.replace("/opt/kvpilot", str(venv))], cwd=context, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    python, kvpilot = venv / "bin" / "python", venv / "bin" / "kvpilot"
    probe = subprocess.run([str(python), "-c", "import importlib.util, kvpilot.operator.handlers; "
                            "print(importlib.util.find_spec('torch') is None)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.strip() == "True", probe.stderr[-3000:]
    for argv, expected in ((["operator", "--help"], "--all-namespaces"), (["--help"], "operator")):
        shown = subprocess.run([str(kvpilot), *argv], env=env, cwd=tmp_path, capture_output=True, text=True,
                               timeout=120)
        assert shown.returncode == 0 and expected in shown.stdout, shown.stderr[-3000:]
