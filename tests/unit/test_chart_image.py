"""The Dockerfile, checked without a Docker engine: what it copies exists and is not excluded by
.dockerignore, it installs from the lockfile, runs as the uid the chart names, and its entrypoint
is the project's console script, and its build stage's install steps, replayed without an
engine, give a working tool. (The image itself is built and run by tests/e2e/test_image.py.)"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def ignored(path: str) -> bool:
    """.dockerignore semantics for the patterns used here: last match wins, ! re-includes."""
    verdict = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        candidates = [path] + [
            str(Path(*Path(path).parts[:i])) for i in range(1, len(Path(path).parts))
        ]
        if any(fnmatch.fnmatch(c, pattern) for c in candidates):
            verdict = not negate
    return verdict


def test_stages_and_copies() -> None:
    steps = instructions()
    stages = [args.split()[-1] for kw, args in steps if kw == "FROM" and " AS " in args.upper()]
    assert stages == ["uv", "build", "runtime"]
    # Bases by build argument (tools/image/build.sh passes local ones); the published build's
    # defaults are the official slim Python image and uv's own.
    froms = [args.split()[0] for kw, args in steps if kw == "FROM"]
    assert froms == ["${UV_IMAGE}", "${BASE_IMAGE}", "${BASE_IMAGE}"]
    defaults = dict(args.split("=", 1) for kw, args in steps if kw == "ARG" and "=" in args)
    assert defaults["BASE_IMAGE"].startswith("python:") and "slim" in defaults["BASE_IMAGE"]
    assert defaults["UV_IMAGE"].startswith("ghcr.io/astral-sh/uv:")
    copied: list[str] = []
    for kw, args in steps:
        if kw != "COPY":
            continue
        words = shlex.split(args)
        if any(w.startswith("--from=") for w in words):
            source = next(w for w in words if w.startswith("--from=")).removeprefix("--from=")
            assert source in stages or "/" in source, f"COPY from unknown stage {source}"
            continue
        copied += words[:-1]
    assert copied == ["pyproject.toml", "uv.lock", "README.md", "src"]
    for source in copied:
        assert (ROOT / source).exists(), f"{source} is copied but does not exist"
        assert not ignored(source), f"{source} is copied but .dockerignore excludes it"
    # The context really is small: tests, charts and the virtualenv stay out.
    for path in ("tests/unit/test_cli.py", ".venv", "charts/neuron-scheduler/Chart.yaml", ".git"):
        assert ignored(path), path
    assert ignored("src/neuron_scheduler/__pycache__/cli.cpython-311.pyc")
    assert not ignored("src/neuron_scheduler/catalog.yaml")


def test_installs_exactly_the_lockfile_without_dev_tools() -> None:
    runs = [args for kw, args in instructions() if kw == "RUN" and "uv sync" in args]
    assert len(runs) == 2
    for run in runs:
        assert "--locked" in run and "--no-dev" in run
    assert "--no-editable" in runs[-1]


def test_entrypoint_is_the_console_script_and_user_is_the_charts() -> None:
    steps = dict(instructions())
    assert steps["ENTRYPOINT"] == '["neuron-scheduler"]'
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["neuron-scheduler"] == "neuron_scheduler.cli:main"
    module, _, function = project["scripts"]["neuron-scheduler"].partition(":")
    source = (ROOT / "src" / Path(*module.split("."))).with_suffix(".py").read_text()
    assert f"\ndef {function}() -> None:" in source
    user = [args for kw, args in instructions() if kw == "USER"]
    assert user == ["65532:65532"]
    extender = (ROOT / "charts/neuron-scheduler/templates/extender.yaml").read_text()
    assert "runAsUser: 65532" in extender and "runAsNonRoot: true" in extender
    # The Python the image runs satisfies the project's requirement.
    version = next(
        args.split("=")[1]
        for kw, args in instructions()
        if kw == "ARG" and "PYTHON_VERSION" in args
    )
    assert project["requires-python"] == f">={version}"


def test_chart_version_follows_the_project() -> None:
    chart = yaml.safe_load((ROOT / "charts/neuron-scheduler/Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The image tag defaults to appVersion, which is the version the image is built from.
    assert chart["appVersion"] == project["version"]


def test_the_build_stage_installs_a_working_tool(tmp_path: Path) -> None:
    """The build stage's own RUN lines, replayed here without an engine: the files it copies,
    its uv environment, then the build directory removed (the runtime stage never sees it)."""
    steps = instructions()
    build = tmp_path / "build"
    build.mkdir()
    for kw, args in steps:
        if kw == "COPY" and not args.startswith("--from="):
            for source in shlex.split(args)[:-1]:
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, build / source)
                else:
                    shutil.copy2(ROOT / source, build / source)
    environment = dict(os.environ)
    for kw, args in steps:
        if kw == "ENV" and "UV_PROJECT_ENVIRONMENT" in args:
            for word in shlex.split(args):
                name, _, value = word.partition("=")
                environment[name] = value
    venv = tmp_path / "venv"
    environment.update(
        UV_PROJECT_ENVIRONMENT=str(venv),  # /opt/neuron-scheduler in the image
        UV_PYTHON=sys.executable,  # the image's /usr/local/bin/python3
    )
    environment.pop("VIRTUAL_ENV", None)  # the test runner's own environment is not the target
    uv = shutil.which("uv") or str(Path.home() / ".local/bin/uv")
    runs = [args for kw, args in steps if kw == "RUN" and "uv sync" in args]
    for run in runs:
        result = subprocess.run(
            run.replace("uv ", f"{uv} ", 1),
            shell=True,
            cwd=build,
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, f"{run}\n{result.stderr}"
    shutil.rmtree(build)
    tool = venv / "bin" / "neuron-scheduler"
    explain = subprocess.run(
        [
            *(str(tool), "explain", "--instance-type", "inf1.6xlarge"),
            *("--resource", "neuroncore", "--count", "9", "--json"),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert explain.returncode == 0, explain.stderr
    assert json.loads(explain.stdout)["cores"] == list(range(9))
    for command in ("extender", "device-plugin", "ultraserver-init"):
        shown = subprocess.run(
            [str(tool), command, "--help"], capture_output=True, text=True, check=False
        )
        assert shown.returncode == 0, shown.stderr
    # --no-dev: the test and lint tools stay out of the image.
    assert not list(venv.glob("lib/python*/site-packages/pytest"))
    assert not list(venv.glob("lib/python*/site-packages/mypy"))
