#!/usr/bin/env bash
# Release check: build the wheel and the sdist, check them, install each into a fresh virtual environment, run
# `trl-plugins list` and the README's demo from there.
#
#   scripts/check_release.sh                 # the demo with 2 GRPO steps (exit 1 "accuracy did not rise" accepted)
#   scripts/check_release.sh --full-demo     # the README's demo as it is (a few minutes on a CPU)
#
# Needs `build`, `twine`, `wheel` and setuptools >= 68 (the dev extras have them). Offline: the packages are built without build isolation
# (setuptools from this environment) and the fresh environments see this environment's packages
# (--system-site-packages) for the dependencies (torch, trl, ...), which are checked against the wheel's
# requirements; trl-plugins itself is installed from the built files with `pip install --no-index`, so nothing is
# downloaded and the copy under test is the built one, never the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python}
FULL_DEMO=0
[ "${1:-}" = "--full-demo" ] && FULL_DEMO=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH

echo "== build (wheel + sdist) into $work/dist"
"$PYTHON" -m build --no-isolation --wheel --sdist --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log"; exit 1; }
ls -l "$work/dist"

echo "== twine check"
"$PYTHON" -m twine check --strict "$work"/dist/*

echo "== contents"
"$PYTHON" "$ROOT/scripts/check_release_contents.py" "$work/dist"

for kind in wheel sdist; do
    venv="$work/venv-$kind"
    echo "== install the $kind into a fresh virtual environment ($venv)"
    "$PYTHON" -m venv --system-site-packages "$venv"
    if [ "$kind" = wheel ]; then
        artefact=$(ls "$work"/dist/*.whl)
    else  # the sdist must build on its own: a wheel is made from it (offline, this environment's setuptools)
        "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$work/from-sdist" "$work"/dist/*.tar.gz
        artefact=$(ls "$work"/from-sdist/*.whl)
    fi
    # --force-reinstall: this environment may have trl-plugins installed (e.g. editable); the venv gets its own
    "$venv/bin/python" -m pip install -q --no-index --no-deps --force-reinstall "$artefact"
    (cd "$work" && "$venv/bin/python" "$ROOT/scripts/check_release_contents.py" --installed "$venv")
    (cd "$work" && "$venv/bin/trl-plugins" list | tee "$work/list-$kind.txt")
    grep -q "^lp_reg " "$work/list-$kind.txt"
    # the documentation the CLI prints comes from the installed modules
    (cd "$work" && "$venv/bin/trl-plugins" show lp_reg > "$work/show-$kind.txt")
    grep -q "^Method:" "$work/show-$kind.txt"
done

echo "== the README's demo, from the wheel's environment"
cd "$work"
if [ "$FULL_DEMO" = 1 ]; then
    "$work/venv-wheel/bin/trl-plugins" demo --output-dir "$work/demo"
else
    # exit status 1 = "held-out accuracy did not rise", expected after 2 steps; any other failure fails the check
    "$work/venv-wheel/bin/trl-plugins" demo --steps 2 --output-dir "$work/demo" || [ $? -eq 1 ]
fi
test -s "$work/demo/summary.json" && test -s "$work/demo/reward_curve.png"
echo "release check passed"
