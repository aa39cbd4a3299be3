#!/usr/bin/env bash
# Ray on a machine with no network (the lent GPU machines): unpack a slim Ray tarball, install its dependency wheels
# from the tarball's deps/ folder, put ray into this Python's site-packages, install tritune editable.
#   bash scripts/offline_ray.sh raypkg/ray_slim.tar.xz
# The tarball (ray/, ray-*.dist-info/, deps/*.whl) is built on a machine with network:
#   pip download ray==2.60.0 --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64
#   and its dependencies into deps/; unzip the ray wheel without its jars, rllib, data, serve, llm, train and tune
#   folders (the whole wheel is over the device tool's 64 MiB carry); tar -cJf ray_slim.tar.xz ray ray-*.dist-info deps
set -euo pipefail
tarball=${1:?usage: offline_ray.sh RAY_TARBALL}
[ -f "$tarball" ] || { echo "offline_ray.sh: no such tarball: $tarball" >&2; exit 2; }
work=$(mktemp -d)
tar -xJf "$tarball" -C "$work"
python -m pip install -q --no-index --find-links "$work/deps" "$work"/deps/*.whl
purelib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -r "$work"/ray "$work"/ray-*.dist-info "$purelib/"
python -m pip install -q --no-deps --no-build-isolation -e .
python -c 'import ray; print("ray", ray.__version__)'
