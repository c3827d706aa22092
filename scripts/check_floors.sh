#!/usr/bin/env bash
# The floors job: every dependency in pyproject.toml at its lower bound (`>=X` becomes `==X`), then the
# fast tests (-m "not kube and not slow"). A failure means a floor is wrong: raise it, or fix the code.
# torch is the exception: its floor's wheel is a multi-GB CUDA build, so the job takes the CPU wheel
# bootstrap.sh installs (pip takes it from its cache or this machine's wheels; no second download).
# The venv is cached in ~/.cache/iterserve/floors-venv and rebuilt when the floors change; iterserve
# itself is installed editable from this checkout at every run. Usage: bash scripts/check_floors.sh [pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
venv=${ITERSERVE_FLOORS_VENV:-$HOME/.cache/iterserve/floors-venv}
torch_pin="torch==2.13.0"
say() { echo "check_floors.sh: $*" >&2; }

# requirements (every extra's, without iterserve's own) and their floors as pins, from pyproject.toml
floors=$("$python" - "$torch_pin" <<'PY'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = list(project["dependencies"])
for extra in project["optional-dependencies"].values():
    requirements += [r for r in extra if not r.startswith("iterserve")]
pins = {}
for r in requirements:
    name = re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("_", "-")
    floor = re.search(r">=\s*([^,;\s]+)", r)
    if not floor:
        sys.exit(f"{r}: no floor (>=) to check")
    pins[name] = sys.argv[1] if name == "torch" else f"{name}=={floor.group(1)}"
print("\n".join(sorted(pins.values())))
PY
)
stamp="$venv/.floors"
if [ "$(cat "$stamp" 2>/dev/null)" != "$floors" ]; then
  say "making $venv with every dependency at its floor:"
  echo "$floors" | tr '\n' ' ' >&2; echo >&2
  # kept across changes of the floors (pip moves each package to its new pin): torch is installed once
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$torch_pin"
  echo "$floors" > "$venv/floors.txt"
  # the pins are both the requirements and the constraints: pip takes exactly the floors, and the
  # newest of everything else they allow
  "${pip[@]}" -c "$venv/floors.txt" -r "$venv/floors.txt" "setuptools>=69" wheel
  echo "$floors" > "$stamp"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
"$venv/bin/python" -m pip check >&2 || { say "the floors are inconsistent (pip check above)"; exit 1; }
cd "$root"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not kube and not slow" "$@"
