#!/usr/bin/env bash
# Installs longctx (editable, with the test extra) into a Python environment, on a CPU-only or a CUDA machine.
# The environment: the active one (VIRTUAL_ENV, or a conda env's CONDA_PREFIX), else `.venv` in the project,
# created with ${PYTHON:-python3} (Python >= 3.10 with its venv module). A system Python is never installed
# into, so Debian/Ubuntu's externally managed Pythons (PEP 668) work. `.venv` names the environment used either
# way (with one active and no `.venv`, `.venv` becomes a link to it), so `.venv/bin/longctx` always runs; remove
# `.venv` to rebuild it, e.g. with another PYTHON.
# torch comes first and is chosen here, because a bare `torch` requirement would pull the newest CUDA build:
# - torch already importable in that environment (e.g. a CUDA machine's own build): kept as it is;
# - a CUDA GPU visible: the registry's default (CUDA) build;
# - otherwise the CPU build torch==2.13.0 (override with TORCH_SPEC=...).
# Running it again is quick: the environment keeps a stamp of the pyproject.toml and install.sh it was set up
# with, and pip runs only when they changed or longctx no longer imports.
set -euo pipefail
cd "$(dirname "$0")"
project=$(pwd -P)

say() { echo "install.sh: $*" >&2; }
die() { say "$*"; exit 1; }

# Checks the interpreter that will be used before anything is created: one line of what to do if it is older
# than 3.10 ($3 says what) or, when $2 is "venv", cannot create virtual environments (Debian/Ubuntu without
# python3-venv).
check_python() {
  local py=$1 need=$2 remedy=$3 major minor has_venv
  command -v "$py" >/dev/null 2>&1 || die "$py not found: install Python >= 3.10 (or name one: PYTHON=/path/to/python3 bash install.sh)"
  read -r major minor has_venv < <("$py" -c '
import sys
try:
    import venv, ensurepip
    ok = 1
except ImportError:
    ok = 0
print("%d %d %d" % (sys.version_info[0], sys.version_info[1], ok))' 2>/dev/null) || true
  [ -n "${minor:-}" ] || die "$py does not run: install Python >= 3.10 (or name one: PYTHON=/path/to/python3 bash install.sh)"
  if (( major < 3 || (major == 3 && minor < 10) )); then
    die "longctx needs Python >= 3.10 and $py is $major.$minor: $remedy"
  fi
  if [ "$need" = venv ] && [ "$has_venv" != 1 ]; then
    if command -v apt-get >/dev/null 2>&1; then
      local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo "
      die "$py ($major.$minor) cannot create virtual environments: ${sudo}apt install python$major.$minor-venv"
    fi
    die "$py ($major.$minor) cannot create virtual environments (no venv/ensurepip module): install its venv support or choose another Python with PYTHON=..."
  fi
}

resolved() { (cd "$1" 2>/dev/null && pwd -P) || true; }

active=${VIRTUAL_ENV:-${CONDA_PREFIX:-}}
if [ -n "$active" ]; then
  env_dir=$active
  [ -x "$env_dir/bin/python" ] || die "the active environment $env_dir has no bin/python: activate a working one, or deactivate to use .venv"
  check_python "$env_dir/bin/python" any "activate an environment with Python >= 3.10, or deactivate to use .venv"
  if [ "$(resolved .venv)" != "$(resolved "$env_dir")" ]; then
    # A link (ours, to an earlier or a removed environment) follows the active one; a real .venv is left alone.
    if [ -L .venv ] || [ ! -e .venv ]; then
      ln -sfn "$env_dir" .venv
    else
      say "note: .venv is another environment; longctx goes into the active one, $env_dir (run its bin/longctx)"
    fi
  fi
elif [ -e .venv ]; then
  env_dir=.venv
  [ -x .venv/bin/python ] || die ".venv is not a working environment (no bin/python): remove it (rm -rf .venv) and run install.sh again"
  check_python .venv/bin/python any "remove .venv and run PYTHON=/path/to/python3.X bash install.sh with Python >= 3.10"
else
  env_dir=.venv
  check_python "${PYTHON:-python3}" venv "install a newer one and run PYTHON=/path/to/python3.X bash install.sh"
  say "creating .venv with ${PYTHON:-python3}"
  # A link left to an environment that no longer exists.
  rm -f .venv
  "${PYTHON:-python3}" -m venv .venv || { rm -rf .venv; die "could not create .venv with ${PYTHON:-python3}"; }
fi
py=$env_dir/bin/python

stamp=$env_dir/.longctx-install
want="$("$py" -c '
import hashlib
h = hashlib.sha256()
for name in ("pyproject.toml", "install.sh"):
    h.update(open(name, "rb").read())
print(h.hexdigest())') $project"
# -I: longctx_cli must import from the environment, not from the current directory.
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$env_dir/bin/longctx" ] \
    && "$py" -I -c "import longctx_cli" 2>/dev/null; then
  say "longctx is already installed in $env_dir (pyproject.toml unchanged); nothing to do"
  exit 0
fi

# uv-made venvs and some conda envs come without pip; ensurepip installs the copy bundled with Python.
if ! "$py" -m pip --version >/dev/null 2>&1; then
  "$py" -m ensurepip --default-pip >/dev/null || die "$env_dir has no pip and ensurepip failed: install pip into it"
fi
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install "${TORCH_SPEC:-torch>=2.5}"
  else
    "$py" -m pip install "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
"$py" -m pip install -e ".[test]"
echo "$want" >"$stamp"
if [ "$(resolved .venv)" = "$(resolved "$env_dir")" ]; then
  say "installed in $env_dir: run .venv/bin/longctx, or \`source .venv/bin/activate\` to have longctx on PATH"
else
  say "installed in $env_dir: run $env_dir/bin/longctx"
fi
