#!/usr/bin/env bash
# A CUDA 13.0 toolchain from PyPI wheels, for building gradflow-trainer with
# `--features cuda` on a machine without a CUDA installation (CI, this project's
# build machines). The target GPUs (NVIDIA H200, driver 580, CUDA 13.0) cannot JIT
# PTX from a newer nvcc, so the compiler is pinned to 13.0.x.
#
#   scripts/cuda-toolchain.sh check    # cargo check -p gradflow-trainer --features cuda
#   scripts/cuda-toolchain.sh build    # cargo build --release … (also fetches link libraries)
#   scripts/cuda-toolchain.sh build-dev  # the same in the dev profile (CI: proves the link)
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
# Wheels whose version does not follow the toolkit's: CUDA 13.0 ships cuRAND 10.4.0.
declare -A wheel_version=([nvidia-curand]=10.4.0.*)

fetch() {
    mkdir -p "$dir/wheels" "$dir/tree"
    local wanted=()
    for name in "$@"; do
        if ! ls "$dir/wheels/${name//-/_}-"*.whl >/dev/null 2>&1; then
            wanted+=("$name==${wheel_version[$name]:-$cuda_version.*}")
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
    # The driver library ships with the driver, not the toolkit. cudarc links the
    # driver API directly, so the linker needs every `cu*` symbol the compiled
    # libraries reference: the stub defines each as an empty function, under the
    # real library's soname, and the binary binds to the real driver at run time.
    local deps=$1
    mkdir -p "$dir/stub"
    local symbols
    symbols=$(for rlib in "$deps"/libcudarc-*.rlib "$deps"/libcandle_*.rlib; do
                  [ -e "$rlib" ] && nm --undefined-only --format=posix "$rlib" 2>/dev/null
              done | awk '$1 ~ /^cu[A-Z]/ {print $1}' | sort -u)
    if [ -z "$symbols" ]; then
        echo "cuda-toolchain: no driver symbols found in $deps" >&2
        exit 1
    fi
    for symbol in $symbols; do echo "void $symbol(void) {}"; done >"$dir/stub/libcuda.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 "$dir/stub/libcuda.c" -o "$dir/stub/libcuda.so"
    echo "cuda-toolchain: stub libcuda.so with $(echo "$symbols" | wc -l) driver symbols" >&2
    local lib=$dir/tree/nvidia/cu13/lib
    for so in "$lib"/*.so.*; do
        [ -e "$so" ] || continue
        local base=${so%%.so.*}.so
        [ -e "$base" ] || ln -s "$(basename "$so")" "$base"
    done
}

# Builds the trainer with CUDA: the libraries first (no link), then the stub from
# the driver symbols they reference, then the binary.
build() {
    local profile=$1
    fetch "${compile_wheels[@]}" "${link_wheels[@]}"
    eval "$(environment)"
    cd "$repo"
    local flags=(-p gradflow-trainer --features cuda)
    [ "$profile" = release ] && flags+=(--release)
    cargo build "${flags[@]}" --lib
    local target=${CARGO_TARGET_DIR:-$repo/target}
    stub_libcuda "$target/$([ "$profile" = release ] && echo release || echo debug)/deps"
    cargo build "${flags[@]}"
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
        build release
        ;;
    build-dev)
        build dev
        ;;
    *)
        echo "usage: $0 [check|build|build-dev|env]" >&2
        exit 2
        ;;
esac
