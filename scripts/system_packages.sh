#!/usr/bin/env bash
# Debian packages the project uses, installed where this machine allows it (root and apt-get), never
# fatal: without them the tests that need them skip with the reason (CI requires them instead).
#   scripts/system_packages.sh bubblewrap chromium
set -u
missing=()
for pkg in "$@"; do
    case "$pkg" in
        bubblewrap) command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap) ;;
        chromium) command -v chromium >/dev/null 2>&1 || missing+=(chromium) ;;
        *) echo "system_packages.sh: unknown package $pkg" >&2; exit 2 ;;
    esac
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian packages: ${missing[*]}" >&2
    if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null); then
        echo "could not install ${missing[*]}; the tests that need them will skip" >&2
    fi
else
    echo "not installing ${missing[*]} (needs root and apt-get); the tests that need them will skip" >&2
fi
exit 0
