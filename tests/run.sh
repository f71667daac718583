#!/usr/bin/env bash
# The whole test suite on a fresh machine, as CI runs it: the virtual environment with the project and its
# developer tools, Debian's Prometheus (the dashboards' queries run against it), the import-layer contracts,
# then every test. Run from anywhere: `bash tests/run.sh` (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet -c constraints.txt -e '.[dev]'
if ! command -v prometheus >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
        echo "tests/run.sh: the dashboards' tests need Debian's prometheus: run 'sudo apt-get install prometheus'" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
.venv/bin/lint-imports
.venv/bin/python -m pytest -n 2 -q -m "slow or not slow" "$@"
