#!/usr/bin/env bash
# Run a command as "nobody" (uid/gid 65534, no capabilities) from this checkout, also where its Python or the
# checkout lives under /root (mode 0700, which nobody cannot enter): in a private mount namespace, /root is
# replaced by a tmpfs holding only those folders (bind mounts). It tests the sandbox's unprivileged deployment
# (docs/sandbox.md) on a machine where only root has a Python. Needs root; run it in its own mount namespace:
#   unshare -m --propagation private .ci/as_nobody.sh .venv/bin/pytest -q -p no:cacheprovider tests/test_sandbox_isolation.py
set -euo pipefail
cd "$(dirname "$0")/.."
needs=()
for p in "$(readlink -f .venv/bin/python)" "$(pwd -P)"; do
    case "$p" in /root/*) needs+=("/root/$(cut -d/ -f3 <<<"$p")") ;; esac
done
if [ ${#needs[@]} -gt 0 ]; then
    aside=/tmp/marlflow-as-nobody-root # an empty folder outside this namespace; reused by every run
    mkdir -p "$aside"
    mount --bind /root "$aside"
    mount -t tmpfs -o mode=755 tmpfs /root
    for d in $(printf '%s\n' "${needs[@]}" | sort -u); do
        mkdir -p "$d"
        mount --bind "$aside/${d#/root/}" "$d"
    done
fi
exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all -- \
    env HOME=/tmp "$@"
