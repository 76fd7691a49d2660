#!/usr/bin/env bash
# Fill the ignored .whl/ folder with what benchmarks/device_setup.sh installs on a device-tool run,
# small enough to carry with the tree (the device tool carries at most 64 MiB in all):
#   numpy 2.4 and the Debian libraries Mooncake loads (../shared/tools/gpu-wheels.sh mooncake);
#   mooncake-engine-cuda13.tar.xz: of the 50 MB mooncake-transfer-engine-cuda13 0.3.14 wheel, only
#     the transfer engine's Python module and the libraries engine.so needs (its RPATH: mooncake/
#     and mooncake_transfer_engine_cuda13.libs/), ~6 MB;
#   yappi, for bench_transfer.py --profile.
# Usage: bash benchmarks/device_wheels.sh      (then run with carry [".whl"])
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
bash ../shared/tools/gpu-wheels.sh mooncake > /dev/null
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps $plat -d .whl yappi
wheel=$(ls .whl/mooncake_transfer_engine_cuda13-*.whl)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m zipfile -e "$wheel" "$tmp"
libs=mooncake_transfer_engine_cuda13.libs
(cd "$tmp" && tar -cJf "$top/.whl/mooncake-engine-cuda13.tar.xz" \
    mooncake/__init__.py mooncake/engine.so mooncake/engine.pyi mooncake/libasio.so mooncake/libetcd_wrapper.so \
    $libs/libyaml-cpp-* $libs/libjsoncpp-* $libs/libglog-* $libs/libgflags-*)
rm "$wheel"
du -sh .whl
