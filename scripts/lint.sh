#!/usr/bin/env bash
# Lint and type checks (run by .ci/run before the tests): ruff over the repository, then mypy over the
# packages, both configured in pyproject.toml. Usage: bash scripts/lint.sh   (after scripts/bootstrap.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
"$python" -m ruff check .
# The packages live in top-level folders that setuptools maps onto iterserve.* (package-dir in
# pyproject.toml); mypy cannot follow that mapping or the editable install's import hook, so it reads a
# tree of links laid out as installed (build/typecheck/iterserve/server -> server/, ...), made from
# package-dir so the two never disagree. Its messages are mapped back to the real paths.
tree=build/typecheck
"$python" - "$tree" <<'PY'
import os, shutil, sys, tomllib
tree = sys.argv[1]
shutil.rmtree(tree, ignore_errors=True)
package_dir = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
for package, folder in package_dir.items():
    link = os.path.join(tree, *package.split("."))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if package == "iterserve":  # the real package folder: only its __init__.py, linked by itself
        os.makedirs(link, exist_ok=True)
        os.symlink(os.path.relpath(os.path.join(folder, "__init__.py"), link), os.path.join(link, "__init__.py"))
    else:
        os.symlink(os.path.relpath(folder, os.path.dirname(link)), link)
PY
"$python" -m mypy 2>&1 | sed -E "s#^($tree/)?iterserve/(server|operator|kernels|common|router|bench)/#\2/#"
