# Sourced at the start of a device-tool run (NVIDIA H200 machine of this workplace): installs what
# the carried .whl/ folder holds (benchmarks/device_wheels.sh fills it):
#   *.whl                            numpy 2.4 (numba-cuda 0.30 fails on the image's numpy 2.5),
#                                    and whatever else a run needs (gguf for kvzip pd-demo)
#   deb/*.deb                        libibverbs1 and friends, which Mooncake loads even for TCP
#   mooncake-engine-cuda13.tar.xz    mooncake/engine.so of mooncake-transfer-engine-cuda13 0.3.14
#                                    and its libraries (the rest of the 50 MB wheel left out)
#   nvcomp-cu13-py312.tar.xz         nvidia-nvcomp-cu13 6.0.0.12 (libnvcomp + the Python module)
# and kvzip itself (editable).  Prints what it installed.
mkdir -p /tmp/ib /tmp/site
for f in .whl/deb/*.deb; do dpkg -x "$f" /tmp/ib; done
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
for t in .whl/*.tar.xz; do [ -e "$t" ] && tar -xJf "$t" -C /tmp/site; done
CUDART=$(python3 -c "import glob, site; print(next(iter(sorted(glob.glob(site.getsitepackages()[0] + '/nvidia/**/libcudart.so.13*', recursive=True))), ''))")
export PYTHONPATH=/tmp/site
export LD_LIBRARY_PATH=/tmp/ib/usr/lib/x86_64-linux-gnu:/tmp/site/nvidia/libnvcomp/lib64:${CUDART%/*}:${LD_LIBRARY_PATH:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . || return 1
python3 -c "import numpy, mooncake.engine, torch; print('numpy', numpy.__version__, '| mooncake engine ok | torch', torch.__version__, torch.cuda.get_device_name())"
python3 -c "from nvidia import nvcomp; print('nvcomp', getattr(nvcomp, '__version__', '?'))" || echo "nvcomp not importable"
