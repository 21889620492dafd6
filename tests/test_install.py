"""install.sh refuses an unusable Python up front: one line of what to install, exit non-zero, nothing created.

Each case runs a copy of install.sh in a temporary project folder, with PYTHON naming a fake interpreter: the
real one, started with a sitecustomize that makes it report 3.9 or hides venv/ensurepip (Debian/Ubuntu without
python3-venv). Nothing is installed and nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MINOR = f"{sys.version_info[0]}.{sys.version_info[1]}"

OLD_PYTHON = "import sys\nsys.version_info = (3, 9, 18, 'final', 0)\n"
NO_VENV = """import sys


class _Hidden:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in ("venv", "ensurepip"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hidden)
"""


def fake_python(folder: Path, sitecustomize: str) -> Path:
    """A script that runs this interpreter with `sitecustomize` loaded first."""
    site = folder / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(sitecustomize)
    script = folder / "python3"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return script


def run_install(tmp_path: Path, python: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Runs a copy of install.sh in a fresh project folder with no environment active; apt-get is on PATH."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("install.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, project / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "apt-get").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH")}
    env.update(PYTHON=python, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    result = subprocess.run(
        ["bash", str(project / "install.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    return result, project


def assert_refused(result: subprocess.CompletedProcess, project: Path) -> str:
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert sorted(p.name for p in project.iterdir()) == ["install.sh", "pyproject.toml"]
    return lines[0]


def test_python_older_than_3_10_is_refused(tmp_path):
    python = fake_python(tmp_path / "py39", OLD_PYTHON)
    line = assert_refused(*run_install(tmp_path, str(python)))
    assert "Python >= 3.10" in line and "3.9" in line


def test_python_without_venv_gets_the_apt_package(tmp_path):
    python = fake_python(tmp_path / "novenv", NO_VENV)
    line = assert_refused(*run_install(tmp_path, str(python)))
    assert f"apt install python{MINOR}-venv" in line


@pytest.mark.parametrize("python", ["python3.0-absent", "/nonexistent/python3"], ids=["name", "path"])
def test_missing_python_is_named(tmp_path, python):
    line = assert_refused(*run_install(tmp_path, python))
    assert python in line and "Python >= 3.10" in line
