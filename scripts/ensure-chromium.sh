#!/usr/bin/env sh
# Install Chromium from the distribution's packages for the headless-browser test of
# `raptor inspect --html` (tests/integration/test_tree_view_browser.py), when it is missing
# and we may install packages (root, or sudo without a password).  Never fails: without
# Chromium that one test skips and says why.
for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then
        exit 0
    fi
done
command -v apt-get >/dev/null 2>&1 || { echo "ensure-chromium: no apt-get; the browser test will skip"; exit 0; }
if [ "$(id -u)" = 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root="sudo -n"
else
    echo "ensure-chromium: not root and no sudo; the browser test will skip"
    exit 0
fi
echo "ensure-chromium: installing chromium (apt-get)"
$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
    || { $as_root apt-get update -qq >/dev/null 2>&1 \
         && $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; } \
    || echo "ensure-chromium: apt-get could not install chromium; the browser test will skip"
exit 0
