#!/usr/bin/env bash
# The Jetson Orin CUDA build, compiled on an x86-64 machine with no GPU: llama-cpp-python 0.3.36 from its
# sdist with the Jetson profiles' CMAKE_ARGS (-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87, plus
# -DGGML_RPC=on as edgerun's own builds use) and this machine's nvcc, and edgerun's bandwidth kernel
# kernels/stream_cuda.cu for sm_87. Proves the sources compile for Orin's GPU and that the libraries hold
# sm_87 code; it does NOT make a library a Jetson can load (that is aarch64 code against JetPack's CUDA 12:
# see docs/devices.md and deploy/install.sh's Jetson path). Nothing here goes into git but the JSON report.
#
#   bench/boards/build_cuda.sh [--work DIR] [--jobs 2] [--arch 87] [STAGE...]
#
# Stages (default: all, in this order; each skips what is already there):
#   deps     the llama-cpp-python 0.3.36 sdist (pip download --no-binary :all:), and, when the toolkit has
#            no cuBLAS, the nvidia-cublas wheel of the toolkit's major version (headers + libcublas*.so);
#            cuobjdump from the nvidia-cuda-cuobjdump wheel when the toolkit has none
#   kernel   nvcc -O3 -arch=sm_ARCH kernels/stream_cuda.cu (seconds), cuobjdump --list-elf on it
#   llama    pip wheel of the sdist with CMAKE_ARGS, build tree kept in WORK/build (ninja; the log in
#            WORK/llama-build.log shows [done/total] steps: progress), nice -n 19, --jobs
#   report   library sizes, `cuobjdump --list-elf` of libggml-cuda.so, build time -> bench/results/
#            cuda_build.json and a table. Also runs on a half-done build: it then reports the progress
#            (ninja steps done of total) and the rate so far.
#
# No GPU is needed and none is used. The driver library libcuda.so is not part of a toolkit without a
# driver; ggml-cuda links it (its VMM pool), so a link stub with only a soname (libcuda.so.1) is made:
# a shared library may leave symbols to the loader, and the real driver provides them on a board.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="${EDGERUN_CUDA_BUILD_DIR:-$HOME/.cache/edgerun/cuda-build}"
jobs=2
arch=87
py="${PYTHON:-python3}"
llama_version=0.3.36
stages=()

while [ $# -gt 0 ]; do
    case "$1" in
        --work) work="${2:?}"; shift ;;
        --jobs) jobs="${2:?}"; shift ;;
        --arch) arch="${2:?}"; shift ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        deps|kernel|llama|report) stages+=("$1") ;;
        *) echo "build_cuda.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
[ ${#stages[@]} -gt 0 ] || stages=(deps kernel llama report)

say() { printf '==> %s\n' "$*"; }
die() { echo "build_cuda.sh: $*" >&2; exit 2; }
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

mkdir -p "$work"
nvcc="${CUDACXX:-$(command -v nvcc || true)}"
[ -x "$nvcc" ] || die "no nvcc (set CUDACXX or put the CUDA toolkit's bin on PATH)"
# the toolkit's own folder (nvcc may be a wrapper script elsewhere on PATH): nvcc's dry run names it
cuda_top="$(cd "$work" 2>/dev/null || cd /tmp; : > .e.cu; "$nvcc" --dryrun -c .e.cu 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1; rm -f .e.cu)"
cuda_root="$(cd "${cuda_top:-$(dirname "$(readlink -f "$nvcc")")/..}" && pwd)"
[ -x "$cuda_root/bin/nvcc" ] && nvcc="$cuda_root/bin/nvcc"
cuda_version="$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
cuda_major="${cuda_version%%.*}"
"$nvcc" --list-gpu-arch | grep -qx "compute_$arch" || die "nvcc $cuda_version cannot target compute_$arch"
dl="$work/downloads"
extra="$work/extra"          # unpacked wheels: cuBLAS headers/libs, cuobjdump
mkdir -p "$dl" "$extra"

find_cublas_inc() {
    local d
    for d in "$cuda_root/include" "$cuda_root"/targets/*/include "$extra"/nvidia/cu*/include "$extra"/nvidia/cublas/include; do
        [ -f "$d/cublas_v2.h" ] && { echo "$d"; return 0; }
    done
    return 1
}
find_cublas_lib() {   # the directory holding libcublas.so*
    local d
    for d in "$cuda_root/lib64" "$cuda_root"/targets/*/lib "$extra"/nvidia/cu*/lib "$extra"/nvidia/cublas/lib; do
        compgen -G "$d/libcublas.so*" >/dev/null && { echo "$d"; return 0; }
    done
    return 1
}
find_cuobjdump() {
    local c
    for c in "$(command -v cuobjdump || true)" "$cuda_root/bin/cuobjdump" "$extra"/nvidia/cu*/bin/cuobjdump; do
        [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
    done
    return 1
}

# --- deps ----------------------------------------------------------------------------------------------
if want deps; then
    sdist="$dl/llama_cpp_python-$llama_version.tar.gz"
    if [ ! -f "$sdist" ]; then
        say "llama-cpp-python $llama_version sdist"
        "$py" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$llama_version" -d "$dl"
    fi
    if ! find_cublas_inc >/dev/null || ! find_cublas_lib >/dev/null; then
        say "no cuBLAS in $cuda_root: nvidia-cublas wheel for CUDA $cuda_major"
        if [ "$cuda_major" -ge 13 ]; then spec="nvidia-cublas==${cuda_version}.*"; else spec="nvidia-cublas-cu${cuda_major}"; fi
        "$py" -m pip download --no-deps "$spec" -d "$dl" || "$py" -m pip download --no-deps "nvidia-cublas==$cuda_major.*" -d "$dl"
        for w in "$dl"/nvidia_cublas*.whl; do (cd "$extra" && "$py" -m zipfile -e "$w" .); done
    fi
    if ! find_cuobjdump >/dev/null; then
        say "no cuobjdump in $cuda_root: nvidia-cuda-cuobjdump wheel"
        # any cuobjdump of the same major version reads the fatbins; the oldest one published is taken
        ver="$("$py" -m pip index versions nvidia-cuda-cuobjdump 2>/dev/null | sed -n 's/^Available versions: //p' \
               | tr ',' '\n' | tr -d ' ' | grep "^$cuda_major\." | grep -v rc | tail -1 || true)"
        "$py" -m pip download --no-deps "nvidia-cuda-cuobjdump${ver:+==$ver}" -d "$dl"
        for w in "$dl"/nvidia_cuda_cuobjdump*.whl; do (cd "$extra" && "$py" -m zipfile -e "$w" .); done
        chmod +x "$extra"/nvidia/cu*/bin/cuobjdump 2>/dev/null || true
    fi
fi
cublas_inc="$(find_cublas_inc || true)"
cublas_lib="$(find_cublas_lib || true)"
cuobjdump="$(find_cuobjdump || true)"

# --- kernel ----------------------------------------------------------------------------------------------
if want kernel; then
    say "kernels/stream_cuda.cu for sm_$arch"
    t0=$(date +%s.%N)
    "$nvcc" -O3 -arch="sm_$arch" "$repo/kernels/stream_cuda.cu" -o "$work/stream_cuda_sm$arch"
    t1=$(date +%s.%N)
    echo "$t0 $t1" > "$work/kernel.time"
    [ -n "$cuobjdump" ] && "$cuobjdump" --list-elf "$work/stream_cuda_sm$arch" | tee "$work/kernel.elf"
fi

# --- llama -----------------------------------------------------------------------------------------------
if want llama; then
    [ -n "$cublas_inc" ] && [ -n "$cublas_lib" ] || die "no cuBLAS headers/libraries: run the deps stage"
    src="$work/llama_cpp_python-$llama_version"
    [ -d "$src" ] || tar -xzf "$dl/llama_cpp_python-$llama_version.tar.gz" -C "$work"
    stub="$work/stub"
    if [ ! -f "$stub/libcuda.so" ]; then
        mkdir -p "$stub"
        echo 'void edgerun_libcuda_link_stub(void) {}' > "$stub/stub.c"
        cc -shared -fPIC -Wl,-soname,libcuda.so.1 "$stub/stub.c" -o "$stub/libcuda.so"
    fi
    cublas_so="$(ls "$cublas_lib"/libcublas.so* | sort | head -1)"
    cublaslt_so="$(ls "$cublas_lib"/libcublasLt.so* | sort | head -1)"
    cmake_args="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_RPC=on"
    # cuBLAS from the wheel and the driver stub, named as FindCUDAToolkit's cache entries so that its
    # CUDA::cublas / CUDA::cuda_driver targets point at them; the headers' folder for nvcc
    cmake_args+=" -DCUDA_cublas_LIBRARY=$cublas_so -DCUDA_cublasLt_LIBRARY=$cublaslt_so"
    cmake_args+=" -DCUDA_cuda_driver_LIBRARY=$stub/libcuda.so -DCMAKE_CUDA_FLAGS=-I$cublas_inc"
    say "llama-cpp-python $llama_version: CMAKE_ARGS=\"$cmake_args\" (jobs $jobs, nice 19; log $work/llama-build.log)"
    date +%s > "$work/llama.start"
    rm -f "$work/llama.end"
    mkdir -p "$work/wheel"
    CUDACXX="$nvcc" CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
        nice -n 19 "$py" -m pip wheel -v --no-deps "$src" -w "$work/wheel" \
        --config-settings=build-dir="$work/build" > "$work/llama-build.log" 2>&1 \
        || die "the build failed: tail $work/llama-build.log"
    date +%s > "$work/llama.end"
fi

# --- report ----------------------------------------------------------------------------------------------
if want report; then
    out="$repo/bench/results/cuda_build.json"
    mkdir -p "$(dirname "$out")"
    WORK="$work" ARCH="$arch" NVCC="$nvcc" CUDA_VERSION="$cuda_version" CUOBJDUMP="$cuobjdump" OUT="$out" \
    LLAMA_VERSION="$llama_version" "$py" - <<'EOF'
import json, os, re, subprocess, time
from pathlib import Path

work, arch = Path(os.environ["WORK"]), os.environ["ARCH"]
cuobjdump = os.environ["CUOBJDUMP"]
report = {"what": "llama-cpp-python %s + kernels/stream_cuda.cu compiled for sm_%s on x86-64, no GPU"
                  % (os.environ["LLAMA_VERSION"], arch),
          "nvcc": os.environ["NVCC"], "cuda": os.environ["CUDA_VERSION"], "host_cores": os.cpu_count()}

def elfs(path):
    if not cuobjdump:
        return None
    r = subprocess.run([cuobjdump, "--list-elf", str(path)], capture_output=True, text=True)
    return sorted(set(re.findall(r"sm_\d+", r.stdout)))

def needed(path):
    """The shared libraries the file names (readelf -d NEEDED), or None without readelf."""
    try:
        r = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", r.stdout)

kern = work / ("stream_cuda_sm%s" % arch)
if kern.exists():
    t0, t1 = (float(x) for x in (work / "kernel.time").read_text().split())
    report["stream_cuda"] = {"seconds": round(t1 - t0, 1), "bytes": kern.stat().st_size, "elf": elfs(kern)}

log = work / "llama-build.log"
if (work / "llama.start").exists():
    start = int((work / "llama.start").read_text())
    end = int((work / "llama.end").read_text()) if (work / "llama.end").exists() else None
    steps = re.findall(r"\[(\d+)/(\d+)\]", log.read_text(errors="replace")) if log.exists() else []
    done, total = (int(steps[-1][0]), int(steps[-1][1])) if steps else (0, 0)
    elapsed = (end or time.time()) - start
    llama = {"finished": end is not None, "seconds": round(elapsed), "ninja_steps_done": done,
             "ninja_steps_total": total, "progress_pct": round(100 * done / total, 1) if total else 0.0}
    if end is None and done:
        llama["steps_per_hour"] = round(done / elapsed * 3600, 1)
        llama["hours_left_at_this_rate"] = round((total - done) / done * elapsed / 3600, 1)
    libs = {}
    for so in sorted((work / "build").rglob("lib*.so*")) if (work / "build").exists() else []:
        if so.is_symlink() or "CMakeFiles" in so.parts or not so.is_file():
            continue
        entry = {"bytes": so.stat().st_size}
        if "cuda" in so.name:
            entry["elf"] = elfs(so)
            entry["needs"] = needed(so)       # libcudart.so.N / libcublas.so.N: the toolkit a board must have
        libs[so.name] = entry
    llama["libraries"] = libs
    # the CUDA objects compiled so far (a half-done build's evidence): how many, and one's ELF targets
    objs = sorted((work / "build").rglob("ggml-cuda.dir/**/*.cu.o")) if (work / "build").exists() else []
    if objs:
        big = max(objs, key=lambda o: o.stat().st_size)
        every = sorted({a for o in objs for a in (elfs(o) or [])})
        llama["cuda_objects"] = {"compiled": len(objs), "largest": big.name, "largest_bytes": big.stat().st_size,
                                 "largest_elf": elfs(big), "elf_of_all": every}
    wheels = sorted((work / "wheel").glob("*.whl"))
    if wheels:
        llama["wheel"] = {"name": wheels[-1].name, "bytes": wheels[-1].stat().st_size}
    report["llama_cpp_python"] = llama

Path(os.environ["OUT"]).write_text(json.dumps(report, indent=2) + "\n")
print("| part | result |\n|---|---|")
if "stream_cuda" in report:
    s = report["stream_cuda"]
    print("| stream_cuda.cu | %.1f s, %d bytes, ELF %s |" % (s["seconds"], s["bytes"], s["elf"]))
if "llama_cpp_python" in report:
    l = report["llama_cpp_python"]
    print("| llama-cpp-python build | %s after %d s: %d/%d steps (%.1f %%) |" % (
        "finished" if l["finished"] else "running/stopped", l["seconds"], l["ninja_steps_done"],
        l["ninja_steps_total"], l["progress_pct"]))
    if "cuda_objects" in l:
        o = l["cuda_objects"]
        print("| CUDA objects compiled | %d, ELF of all: %s (largest %s, %.1f MB) |" % (
            o["compiled"], o["elf_of_all"], o["largest"], o["largest_bytes"] / 1e6))
    for name, e in l["libraries"].items():
        print("| %s | %.1f MB%s%s |" % (name, e["bytes"] / 1e6, ", ELF %s" % e["elf"] if "elf" in e else "",
                                        ", needs %s" % ", ".join(n for n in e["needs"] if "cu" in n)
                                        if e.get("needs") else ""))
print("wrote", os.environ["OUT"])
EOF
fi
