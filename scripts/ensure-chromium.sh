#!/usr/bin/env bash
# Makes sure a Chromium is present for the browser test (tests/test_browser.py). Never fails the build:
# where Chromium cannot be installed, it says why, and the test is skipped with that reason.
for name in "${CHROMIUM_PATH:-}" chromium chromium-browser google-chrome; do
  if [ -n "$name" ] && command -v "$name" >/dev/null 2>&1; then exit 0; fi
done
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-chromium: no Chromium and no apt-get here; install Chromium (or set CHROMIUM_PATH) to run the browser test."
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
  echo "ensure-chromium: no Chromium, and installing it needs root: run 'sudo apt-get install chromium' to enable the browser test."
  exit 0
fi
echo "ensure-chromium: installing Debian's chromium for the browser test..."
export DEBIAN_FRONTEND=noninteractive
if ! $sudo apt-get install -y -q chromium >/tmp/ensure-chromium.log 2>&1; then
  $sudo apt-get update -q >>/tmp/ensure-chromium.log 2>&1
  $sudo apt-get install -y -q chromium >>/tmp/ensure-chromium.log 2>&1 || {
    echo "ensure-chromium: apt-get could not install chromium (see /tmp/ensure-chromium.log); the browser test will be skipped."
    exit 0
  }
fi
echo "ensure-chromium: $(chromium --version 2>/dev/null)"
