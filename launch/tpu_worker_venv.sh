#!/usr/bin/env bash
# Run by launch/tpu_pod.sh on every worker of a slice, in its copy of this repository: makes
# .venv there with a Python the package supports (3.11 or newer, setup.py). TPU VM images such
# as tpu-ubuntu2204-base have only 3.10: python3.11 then comes from Ubuntu's packages (sudo
# works on a TPU VM). A .venv of a supported Python is kept.
set -euo pipefail

supported() {
  command -v "$1" >/dev/null && "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))'
}
supported .venv/bin/python3 && exit 0
python=""
for candidate in python3 python3.13 python3.12 python3.11; do
  if supported "$candidate"; then python=$candidate && break; fi
done
if [[ -z "$python" ]]; then
  echo "$(hostname): python3 is $(python3 --version 2>&1 || echo 'missing'), the package needs" \
    "3.11 or newer: installing python3.11" >&2
  sudo apt-get update -qq
  # A fresh VM's unattended upgrades may hold dpkg's lock for minutes: wait for it.
  sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
    python3.11 python3.11-venv
  python=python3.11
fi
"$python" -m venv --clear .venv
