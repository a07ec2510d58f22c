#!/usr/bin/env bash
# A CUDA 13.0 toolchain from PyPI wheels, for building gradflow-trainer with
# `--features cuda` on a machine without a CUDA installation (CI, this project's
# build machines). The target GPUs (NVIDIA H200, driver 580, CUDA 13.0) cannot JIT
# PTX from a newer nvcc, so the compiler is pinned to 13.0.x.
#
#   scripts/cuda-toolchain.sh check    # cargo check -p gradflow-trainer --features cuda
#   scripts/cuda-toolchain.sh build    # cargo build --release … (also fetches link libraries)
#   source <(scripts/cuda-toolchain.sh env)   # the environment, for your own cargo commands
#
# Everything goes under $GRADFLOW_CUDA_DIR (default: .cuda/ in the repository, ignored
# by git). Downloads once; later runs reuse it.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${GRADFLOW_CUDA_DIR:-$repo/.cuda}
cuda_version=13.0
compute_cap=${CUDA_COMPUTE_CAP:-90}

# Compiling kernels needs these; linking the binary also needs the libraries below.
compile_wheels=(nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt nvidia-cuda-runtime nvidia-cuda-cccl)
link_wheels=(nvidia-cublas nvidia-cuda-nvrtc nvidia-curand)

fetch() {
    mkdir -p "$dir/wheels" "$dir/tree"
    local wanted=()
    for name in "$@"; do
        if ! ls "$dir/wheels/${name//-/_}-"*.whl >/dev/null 2>&1; then
            wanted+=("$name==$cuda_version.*")
        fi
    done
    if [ ${#wanted[@]} -gt 0 ]; then
        echo "cuda-toolchain: downloading ${wanted[*]}" >&2
        python3 -m pip download --quiet --no-deps --only-binary=:all: \
            --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
            --platform manylinux2010_x86_64 --python-version 3.11 \
            --dest "$dir/wheels" "${wanted[@]}"
    fi
    for wheel in "$dir"/wheels/*.whl; do
        python3 -m zipfile -e "$wheel" "$dir/tree"
    done
    chmod +x "$dir"/tree/nvidia/cu13/bin/* "$dir"/tree/nvidia/cu13/nvvm/bin/* 2>/dev/null || true
}

environment() {
    local home=$dir/tree/nvidia/cu13
    echo "export CUDA_HOME='$home'"
    echo "export CUDA_PATH='$home'"
    echo "export PATH='$home/bin':\"\$PATH\""
    echo "export CUDA_COMPUTE_CAP=$compute_cap"
    echo "export CUDARC_CUDA_VERSION=13000"
    echo "export LIBRARY_PATH='$home/lib:$dir/stub'\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
}

stub_libcuda() {
    # The driver library ships with the driver, not the toolkit; a stub with no
    # symbols satisfies the linker (cudarc loads the real one at run time).
    mkdir -p "$dir/stub"
    if [ ! -e "$dir/stub/libcuda.so" ]; then
        echo 'void gradflow_cuda_stub(void) {}' | cc -shared -fPIC -x c - -o "$dir/stub/libcuda.so"
    fi
    local lib=$dir/tree/nvidia/cu13/lib
    for so in "$lib"/*.so.*; do
        [ -e "$so" ] || continue
        local base=${so%%.so.*}.so
        [ -e "$base" ] || ln -s "$(basename "$so")" "$base"
    done
}

case "${1:-check}" in
    env)
        fetch "${compile_wheels[@]}"
        environment
        ;;
    check)
        fetch "${compile_wheels[@]}"
        eval "$(environment)"
        nvcc --version | tail -1 >&2
        cd "$repo" && cargo check -p gradflow-trainer --features cuda
        ;;
    build)
        fetch "${compile_wheels[@]}" "${link_wheels[@]}"
        stub_libcuda
        eval "$(environment)"
        cd "$repo" && cargo build --release -p gradflow-trainer --features cuda
        ;;
    *)
        echo "usage: $0 [check|build|env]" >&2
        exit 2
        ;;
esac
