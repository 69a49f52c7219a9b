#!/usr/bin/env bash
# The GPU cost curve of the real Qwen pair's shapes, for a lent x86-64 NVIDIA machine (H100/H200, CUDA 13,
# CMake, Python with numpy) that has NO network and takes at most 64 MiB of files per call. Prepared here,
# run there; `--cpu` runs the same steps on this CPU with toy shapes (a dry run that proves the script).
#
#   bench/gpu_curve.sh pack                      here: the trimmed llama.cpp + llama-cpp-python source and a
#                                                diskcache wheel into .gpu-carry/ (git-ignored; carry it)
#   bench/gpu_curve.sh [--out DIR] build         there: llama.cpp with -DGGML_CUDA=on
#                                                -DCMAKE_CUDA_ARCHITECTURES=90 (libs + llama-bench), the
#                                                llama_cpp Python package over those libs, in .gpu-build/
#   bench/gpu_curve.sh [--out DIR] measure       there: random-weight GGUFs with exactly the Qwen2.5-Coder-1.5B
#                                                and 0.5B tensors (bench/gpu_shapes/), then bench/gpu_curve.py
#                                                (edgerun's probes: T(n)/T(1) n=1..9 with logits at every
#                                                position, drafter/target step ratio, plain decode tok/s,
#                                                one-token vs batched logits bit for bit, the CUDA bandwidth
#                                                kernel vs the card's rated bandwidth) and llama-bench
#   bench/gpu_curve.sh --cpu [--out DIR] all     the dry run: pack, no CUDA (this machine's installed
#                                                llama-cpp-python), --tiny models, n_gpu_layers 0
#
# Timing depends on the tensors' shapes and storage types, not on the weights' values: random weights of
# the right shapes and types give the real pair's step times (bench/gpu_curve.py says how the blocks are
# filled). Results in bench/results/ and, copied, in $OUT (what comes back from the lent machine):
# gpu_curve-gpu.json (edgerun's probes), gpu_curve-gpu-llama-bench-*.json, predict-gpu.json (measure runs
# bench/predict_gpu.py --curve on the measured curve: the tuner's gamma and predicted speed-up).
#
# On the lent GPU machine: a task has 15 minutes of its time, every call and the machine's start (1-2 min)
# counted together, and a machine stays warm only ~30 s after a call. So one call does both stages:
#   run(carry=[".gpu-carry"], timeout_s=540, command="bash bench/gpu_curve.sh --out $OUT build measure")
# and only if it ran out of time, the same call again AT ONCE with the time left (ninja resumes the build and
# the random models are kept on the still-warm machine; a fresh machine starts bare). $OUT/gpu_build.log shows
# how far the build got; measure's own lines print as they come (PYTHONUNBUFFERED).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
carry="$repo/.gpu-carry"
build="$repo/.gpu-build"
llama_version=0.3.36
arch=90
cpu=0
out="${OUT:-}"
jobs="$(nproc)"
stages=()

while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) cpu=1 ;;
        --out) out="${2:?}"; shift ;;
        --arch) arch="${2:?}"; shift ;;
        --jobs) jobs="${2:?}"; shift ;;
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        pack|build|measure|all) stages+=("$1") ;;
        *) echo "gpu_curve.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
[ ${#stages[@]} -gt 0 ] || { echo "gpu_curve.sh: name a stage: pack, build, measure or all" >&2; exit 2; }
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
say() { printf '==> %s\n' "$*"; }
die() { echo "gpu_curve.sh: $*" >&2; exit 2; }
py="${PYTHON:-python3}"
[ "$cpu" = 1 ] && py="${PYTHON:-$repo/.venv/bin/python}"
[ -n "$out" ] && mkdir -p "$out"
results="$repo/bench/results"
mkdir -p "$results"
tag=$([ "$cpu" = 1 ] && echo cpu-dry-run || echo gpu)

# --- pack (here, with network): what the offline machine needs that is not in the repo -----------------
if want pack; then
    mkdir -p "$carry"
    sdist="$carry/llama_cpp_python-$llama_version.tar.gz"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    say "llama-cpp-python $llama_version sdist, trimmed"
    if [ -n "${LLAMA_SDIST:-}" ]; then          # an sdist downloaded already (bench/boards/build_cuda.sh's)
        cp "$LLAMA_SDIST" "$tmp/"
    else
        "$py" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$llama_version" -d "$tmp"
    fi
    tar -xzf "$tmp/llama_cpp_python-$llama_version.tar.gz" -C "$tmp"
    src="$tmp/llama_cpp_python-$llama_version"
    v="$src/vendor/llama.cpp"
    # not needed to build the libraries and llama-bench: the sdist's git history (50 MB), the test vocabularies (75 MB), docs, web UI assets, benches, and
    # the ggml backends that are not built (each only configured when its GGML_<NAME> option is on)
    rm -rf "$src/.git" "$v/models" "$v/docs" "$v/media" "$v/tools/server/public" "$v/tools/ui" "$v/benches" \
           "$v/examples/model-conversion" "$v/tests"/*.gguf "$src/docs" "$src/examples" "$src/tests" \
           "$v"/ggml/src/ggml-{vulkan,sycl,opencl,hexagon,metal,et,cann,webgpu,zdnn}
    mkdir -p "$v/models"
    tar -C "$tmp" -cJf "$carry/llama-src.tar.xz" "llama_cpp_python-$llama_version"
    "$py" -m pip download -q --no-deps --only-binary=:all: "diskcache==5.6.3" -d "$carry"
    du -sh "$carry"/*
    rm -rf "$tmp"
    trap - EXIT
fi

# --- build (there): CUDA for sm_$arch; the Python package over the built libraries --------------------
site="$build/site"
if want build && [ "$cpu" = 0 ]; then
    command -v nvcc >/dev/null || die "no nvcc on PATH"
    [ -f "$carry/llama-src.tar.xz" ] || die "no $carry/llama-src.tar.xz: run 'pack' here and carry .gpu-carry"
    mkdir -p "$build"
    [ -d "$build/llama_cpp_python-$llama_version" ] || tar -xJf "$carry/llama-src.tar.xz" -C "$build"
    src="$build/llama_cpp_python-$llama_version"
    # cuBLAS: the toolkit's, else the nvidia-cublas wheel's (the GPU image ships it beside PyTorch)
    extra=()
    cuda_top="$(cd /tmp && : > .e.cu && nvcc --dryrun -c .e.cu 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
    if ! compgen -G "$cuda_top/lib64/libcublas.so*" >/dev/null && ! compgen -G "$cuda_top/targets/*/lib/libcublas.so*" >/dev/null; then
        wheel_dir="$("$py" -c 'import nvidia.cu13 as m; print(list(m.__path__)[0])' 2>/dev/null \
                    || "$py" -c 'import nvidia.cublas as m; print(list(m.__path__)[0])' 2>/dev/null)" \
            || die "no cuBLAS in the toolkit ($cuda_top) and no nvidia-cublas wheel for $py"
        cl="$(ls "$wheel_dir"/lib/libcublas.so* | head -1)"; clt="$(ls "$wheel_dir"/lib/libcublasLt.so* | head -1)"
        extra=(-DCUDA_cublas_LIBRARY="$cl" -DCUDA_cublasLt_LIBRARY="$clt" -DCMAKE_CUDA_FLAGS="-I$wheel_dir/include")
        say "cuBLAS from the wheel at $wheel_dir"
    fi
    # the driver library ggml-cuda links: the toolkit's link stub, else the installed driver's
    if ! compgen -G "$cuda_top/lib64/stubs/libcuda.so" >/dev/null && ! compgen -G "$cuda_top/targets/*/lib/stubs/libcuda.so" >/dev/null; then
        drv="$(ldconfig -p | sed -n 's/.*libcuda\.so\.1 .*=> //p' | head -1)"
        [ -n "$drv" ] && extra+=(-DCUDA_cuda_driver_LIBRARY="$drv")
    fi
    say "llama.cpp (vendored in llama-cpp-python $llama_version): CUDA sm_$arch, $jobs jobs"
    t0=$(date +%s)
    cmake -S "$src/vendor/llama.cpp" -B "$build/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_RPC=on -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TOOLS=ON ${extra[@]+"${extra[@]}"} > "$build/configure.log" 2>&1 \
        || { tail -30 "$build/configure.log"; die "configure failed"; }
    # the log also goes to $OUT, which comes back even when the call runs out of time
    cmake --build "$build/cmake" -j "$jobs" --target llama llama-bench 2>&1 \
        | tee "$build/build.log" > "${out:-$build}/gpu_build.log" \
        || { tail -30 "$build/build.log"; die "build failed"; }
    echo "$(( $(date +%s) - t0 ))" > "$build/build.seconds"
    rm -rf "$site" && mkdir -p "$site/llama_cpp/lib"
    cp -r "$src/llama_cpp/." "$site/llama_cpp/"
    cp -P "$build"/cmake/bin/lib*.so* "$site/llama_cpp/lib/"
    "$py" -m pip install -q --no-index --no-deps --target "$site" "$carry"/diskcache-*.whl
    say "built in $(cat "$build/build.seconds") s; libraries: $(ls "$site/llama_cpp/lib" | tr '\n' ' ')"
    command -v cuobjdump >/dev/null && cuobjdump --list-elf "$site/llama_cpp/lib/libggml-cuda.so" | head -3
fi

# --- measure ---------------------------------------------------------------------------------------------
if want measure; then
    export PYTHONUNBUFFERED=1
    models="$build/models"
    mkdir -p "$models"
    if [ "$cpu" = 1 ]; then
        export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
        tiny=(--tiny); ngl=0; gpu_flags=(); bench_bin="${LLAMA_BENCH:-}"
    else
        export PYTHONPATH="$repo:$site:$build/llama_cpp_python-$llama_version/vendor/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
        tiny=(); ngl=-1; bench_bin="$build/cmake/bin/llama-bench"
        name="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
        # rated memory bandwidth (NVIDIA datasheets): H100 SXM5 80 GB HBM3 3.35 TB/s, H100 PCIe 2.0 TB/s,
        # H200 141 GB HBM3e 4.8 TB/s
        case "$name" in
            *H200*) rated=4800 ;; *H100*PCIe*) rated=2000 ;; *H100*) rated=3350 ;; *) rated="" ;;
        esac
        gpu_flags=(--gpu ${rated:+--rated-gbs "$rated"})
        say "GPU: $name (rated ${rated:-?} GB/s)"
    fi
    for m in qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct; do
        f="$models/$m${tiny:+-tiny}.gguf"
        [ -f "$f" ] || "$py" "$here/gpu_curve.py" write "$here/gpu_shapes/$m.json" "$f" ${tiny[@]+"${tiny[@]}"}
    done
    t="$models/qwen2.5-coder-1.5b-instruct${tiny:+-tiny}.gguf"
    d="$models/qwen2.5-coder-0.5b-instruct${tiny:+-tiny}.gguf"
    json="$results/gpu_curve-$tag.json"
    "$py" "$here/gpu_curve.py" measure --target "$t" --draft "$d" --out "$json" --n-gpu-layers "$ngl" \
        --threads "$([ "$cpu" = 1 ] && echo 2 || echo 4)" ${gpu_flags[@]+"${gpu_flags[@]}"}
    if [ -n "$bench_bin" ] && [ -x "$bench_bin" ]; then
        # llama-bench's view: pp n = one batched eval of n tokens, tg = one-token decode
        for f in "$t" "$d"; do
            "$bench_bin" -m "$f" -ngl 99 -fa on -p 1,2,3,4,5,6,7,8,9 -n 128 -r 5 -o json \
                > "${json%.json}-llama-bench-$(basename "$f" .gguf).json" || say "llama-bench failed on $f"
        done
    else
        say "no llama-bench here (the CPU dry run uses the installed Python package only)"
    fi
    [ -f "$build/build.seconds" ] && cp "$build/build.seconds" "$results/gpu_curve-$tag-build-seconds.txt"
    "$py" "$here/predict_gpu.py" --curve "$json" --out "$results/predict-$tag.json" || say "prediction failed"
    if [ -n "$out" ]; then
        cp "$results"/gpu_curve-"$tag"*.json "$out"/ 2>/dev/null || true
        cp "$results/predict-$tag.json" "$out"/ 2>/dev/null || true
    fi
fi
