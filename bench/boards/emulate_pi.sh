#!/usr/bin/env bash
# An emulated Raspberry Pi: a Debian bookworm arm64 userspace (Raspberry Pi OS Bookworm is Debian 12)
# run under qemu-user, with llama-cpp-python's native libraries CROSS-compiled on this x86-64 host with
# each Pi profile's CMAKE_ARGS, and edgerun checked inside it against the x86 build and the exact numpy
# forward. Nothing of it goes into git: everything lands under --work.
#
#   sudo bench/boards/emulate_pi.sh [--work DIR] [--profiles "rpi5-8gb rpi4-8gb"] [--jobs 2] [STAGE...]
#
# Stages (default: all, in this order; each skips what is already there):
#   host     check the host tools and register qemu-aarch64 with binfmt_misc
#            (apt-get install qemu-user-static binfmt-support mmdebstrap gcc-aarch64-linux-gnu
#             g++-aarch64-linux-gnu cmake)
#   rootfs   mmdebstrap a bookworm arm64 root filesystem (python3, venv, systemd, gcc, libgomp1)
#   wheels   aarch64 wheels of edgerun's dependencies (pip download --platform ...) and edgerun's own wheel
#   llama    per profile, cross-compile the libraries llama-cpp-python loads (llama, ggml, ggml-base,
#            ggml-cpu, ggml-rpc) from its sdist with the profile's CMAKE_ARGS (read with `edgerun service
#            build-flags --profile P`) + -DGGML_RPC=on, as `edgerun bundle` builds it, and the aarch64
#            toolchain file (nice -n 10, --jobs); check the -march and the
#            dotprod (sdot) instructions in the CPU kernels; pack them with the package as an aarch64 wheel
#   venvs    per profile, a venv inside the rootfs with that wheel, edgerun and its dependencies (offline)
#   checks   per profile, inside the emulation: detection on the board's real files, greedy
#            `edgerun generate`, teacher-forced logits, lookup-speculative == plain greedy at 1 thread,
#            the bandwidth probe's C kernel cross-compiled and run; on the host: the x86 build's logits,
#            the exact numpy forward, and the comparison table (results/compare.json)
#   install  deploy/install.sh for real inside the rootfs (the first profile), llama.cpp build replaced
#            by the cross-built wheel (--llama-wheel), then `systemd-analyze verify` on the unit
#   bundle   the offline path of docs/deploy.md for the first profile (needs host, rootfs and llama only):
#            `edgerun bundle --model M` (--bundle-model, default smollm2-135m-instruct) here with the
#            cross-built wheel and the rootfs's CPython (timed, sized); a fresh install of it in the
#            rootfs by its install.sh under `unshare -n` (no network: no package index; timed); the
#            installed unit's ExecStart with its Environment=/EnvironmentFile= (unit_exec.py), as nobody,
#            still without network, until /health is ok; one POST /v1/chat/completions from the same
#            network namespace; results/bundle.json and a table (bundle_report.py). The install's and the
#            service's times are emulated: they say nothing of a board's speed
#
# Emulated speed means nothing: no timing from here is a board's speed. Only the bundle stage prints
# times: the bundle's (made on this host) and the emulated install's and start's, labelled emulated.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="${EDGERUN_EMU_DIR:-$HOME/.cache/edgerun/emu}"
profiles="rpi5-8gb rpi4-8gb"
jobs=2
py="${PYTHON:-$repo/.venv/bin/python}"          # the host's edgerun (x86 build of llama-cpp-python)
model="${EDGERUN_EMU_MODEL:-$HOME/.cache/edgerun/models/smollm2-135m-instruct.gguf}"
llama_version=0.3.36
positions=300
bundle_model=smollm2-135m-instruct      # the bundle stage's model (a registry name)
stages=()

while [ $# -gt 0 ]; do
    case "$1" in
        --work) work="${2:?}"; shift ;;
        --profiles) profiles="${2:?}"; shift ;;
        --jobs) jobs="${2:?}"; shift ;;
        --model) model="${2:?}"; shift ;;
        --positions) positions="${2:?}"; shift ;;
        --bundle-model) bundle_model="${2:?}"; shift ;;
        -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
        host|rootfs|wheels|llama|venvs|checks|install|bundle) stages+=("$1") ;;
        *) echo "emulate_pi.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
[ ${#stages[@]} -gt 0 ] || stages=(host rootfs wheels llama venvs checks install bundle)

rootfs="$work/rootfs"
wheels="$work/wheels-arm64"
results="$work/results"
mkdir -p "$work" "$results"
say() { printf '==> %s\n' "$*"; }
die() { echo "emulate_pi.sh: $*" >&2; exit 2; }
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap, chroot and mounts need it)"
[ -x "$py" ] || die "no host Python with edgerun at $py (python3 -m venv .venv && .venv/bin/pip install -e '.[test]')"

# --- mounts for running inside the rootfs (undone on exit) -----------------------------------------
mounted=()
mount_in() {   # mount_in SRC DEST [mount args...]
    local src="$1" dest="$rootfs$2"; shift 2
    mountpoint -q "$dest" && return 0
    mkdir -p "$dest"
    mount "$@" "$src" "$dest"
    mounted+=("$dest")
}
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[$i]}" || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# in_pi ENV... -- CMD...: run CMD in the emulated Pi (chroot; qemu-aarch64 runs it through binfmt_misc)
in_pi() {
    local envs=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    chroot "$rootfs" /usr/bin/env -i "${envs[@]}" "$@"
}

# --- host ----------------------------------------------------------------------------------------
if want host; then
    for t in qemu-aarch64-static mmdebstrap aarch64-linux-gnu-gcc aarch64-linux-gnu-g++ cmake update-binfmts; do
        command -v "$t" >/dev/null || die "missing $t: apt-get install qemu-user-static binfmt-support mmdebstrap gcc-aarch64-linux-gnu g++-aarch64-linux-gnu cmake"
    done
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
    say "host: $(qemu-aarch64-static --version | head -1); $(aarch64-linux-gnu-gcc --version | head -1)"
fi

# --- rootfs --------------------------------------------------------------------------------------
if want rootfs && [ ! -x "$rootfs/usr/bin/python3" ]; then
    say "rootfs: Debian bookworm arm64 in $rootfs"
    rm -rf "$rootfs.tmp"
    nice -n 10 mmdebstrap --arch=arm64 --variant=apt \
        --include=python3,python3-venv,python3-dev,libgomp1,gcc,libc6-dev,systemd,ca-certificates \
        bookworm "$rootfs.tmp" http://deb.debian.org/debian
    mv "$rootfs.tmp" "$rootfs"
fi

# --- wheels --------------------------------------------------------------------------------------
if want wheels; then
    pyver="$(in_pi -- python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
    say "wheels: aarch64 wheels for the rootfs's CPython $pyver in $wheels"
    mkdir -p "$wheels"
    nice -n 10 "$py" -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
        --abi "cp$pyver" --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
        --platform manylinux_2_28_aarch64 --platform linux_aarch64 -d "$wheels" \
        "numpy>=1.24" "gguf>=0.17" "click>=8.1" "pyyaml>=6.0" "psutil>=5.9" "jinja2>=3.1" \
        "fastapi>=0.110" "uvicorn>=0.29" "pydantic>=2" diskcache typing-extensions "setuptools>=68" wheel pip
    rm -f "$wheels"/edgerun-*.whl
    nice -n 10 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" "$repo"
fi

# --- llama: the cross builds ---------------------------------------------------------------------
sdist="$work/src/llama_cpp_python-$llama_version.tar.gz"
src="$work/src/llama_cpp_python-$llama_version"
llama_wheel() { ls "$work/wheels-$1"/llama_cpp_python-"$llama_version"-*linux_aarch64.whl 2>/dev/null | head -1 || true; }
# pack_wheel LIBDIR OUTDIR: the llama_cpp Python package of the sdist + the cross-built libraries in
# llama_cpp/lib (where the package loads them from), as the wheel pip would build (ctypes only, no
# CPython extension: the tag is py3-none-linux_aarch64)
pack_wheel() {
    local libs="$1" out="$2" stage="$work/stage" di f
    rm -rf "$stage" "$out"; mkdir -p "$stage" "$out"
    cp -r "$src/llama_cpp" "$stage/"
    rm -rf "$stage/llama_cpp/lib"; mkdir -p "$stage/llama_cpp/lib"
    for f in "$libs"/lib*.so*; do cp -L "$f" "$stage/llama_cpp/lib/$(basename "$f")"; done
    di="$stage/llama_cpp_python-$llama_version.dist-info"
    mkdir -p "$di"
    cp "$src/PKG-INFO" "$di/METADATA"
    printf 'Wheel-Version: 1.0\nGenerator: edgerun bench/boards/emulate_pi.sh\nRoot-Is-Purelib: false\nTag: py3-none-linux_aarch64\n' >"$di/WHEEL"
    "$py" -m wheel pack "$stage" -d "$out" >/dev/null
    rm -rf "$stage"
}
if want llama; then
    if [ ! -d "$src" ]; then
        [ -f "$sdist" ] || "$py" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$llama_version" -d "$work/src"
        tar -xzf "$sdist" -C "$work/src"
    fi
    for p in $profiles; do
        flags="$("$py" -m edgerun service build-flags --profile "$p")"
        cmake_args="$("$py" -c 'import json, sys; print(json.loads(sys.argv[1])["cmake_args"])' "$flags")"
        libs="$work/libs-$p"
        # + ggml's RPC backend, as `edgerun bundle` builds llama-cpp-python (`edgerun worker` and --rpc on a Pi)
        if [ ! -f "$libs/libllama.so" ] || [ ! -f "$libs/libggml-rpc.so" ]; then
            say "llama: cross-compiling llama.cpp (llama-cpp-python $llama_version) for $p with CMAKE_ARGS='$cmake_args'"
            b="$work/build-$p"
            rm -rf "$b" "$libs"; mkdir -p "$libs"
            # only the libraries the Python package loads (not llama.cpp's common library or the
            # multimodal one, which edgerun does not use): Release, like pip's build
            # shellcheck disable=SC2086
            { cmake -S "$src" -B "$b" -DCMAKE_BUILD_TYPE=Release -DCMAKE_TOOLCHAIN_FILE="$here/aarch64-linux-gnu.cmake" \
                  -DLLAVA_BUILD=OFF $cmake_args -DGGML_RPC=on &&
              nice -n 10 cmake --build "$b" -j "$jobs" --verbose --target llama ggml ggml-base ggml-cpu ggml-rpc; } \
                >"$libs/build.log" 2>&1 || { tail -30 "$libs/build.log"; die "cross build for $p failed ($libs/build.log)"; }
            cp -a "$b"/bin/lib*.so* "$libs/"
            rm -rf "$b"
        fi
        march="${cmake_args##*GGML_CPU_ARM_ARCH=}"; march="${march%% *}"
        grep -q -- "-march=$march" "$libs/build.log" || die "$p: the build log shows no -march=$march"
        # the instructions the flags promise are in the CPU kernels, and none the board lacks
        n_sdot="$(aarch64-linux-gnu-objdump -d "$libs/libggml-cpu.so" | grep -cw sdot || true)"
        case "$march" in
            *dotprod*) [ "$n_sdot" -gt 0 ] || die "$p: libggml-cpu.so has no sdot (dotprod) instruction" ;;
            *) [ "$n_sdot" = 0 ] || die "$p: libggml-cpu.so has $n_sdot sdot instructions, -march=$march has none" ;;
        esac
        say "llama: $p: -march=$march; $n_sdot sdot (dotprod) instructions in libggml-cpu.so"
        w="$(llama_wheel "$p")"
        if [ -z "$w" ] || [ "$libs/libllama.so" -nt "$w" ]; then pack_wheel "$libs" "$work/wheels-$p"; fi
    done
fi

# --- venvs inside the rootfs ---------------------------------------------------------------------
if want venvs || want checks || want install; then
    mount_in proc /proc -t proc
    mount_in /dev /dev --bind
    mkdir -p "$rootfs/wheels" "$rootfs/checks" "$rootfs/root/.cache/edgerun/models"
    cp -u "$wheels"/*.whl "$rootfs/wheels/"
    rm -rf "$rootfs/boards"; cp -r "$repo/tests/fixtures/boards" "$rootfs/boards"
    cp "$here/pi_checks.py" "$rootfs/checks/"
    dest="$rootfs/root/.cache/edgerun/models/$(basename "$model")"
    [ -f "$dest" ] || ln "$model" "$dest" 2>/dev/null || cp "$model" "$dest"
fi
if want venvs; then
    for p in $profiles; do
        if [ ! -x "$rootfs/opt/check-$p/bin/python" ]; then
            say "venvs: /opt/check-$p in the rootfs (offline, from $rootfs/wheels)"
            in_pi -- python3 -m venv "/opt/check-$p"
        fi
        # edgerun's dependencies first (they need no llama build), then the cross-built wheel and edgerun
        in_pi PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels -- "/opt/check-$p/bin/pip" install -q \
            "numpy>=1.24" "gguf>=0.17" "click>=8.1" "pyyaml>=6.0" "psutil>=5.9" "jinja2>=3.1" diskcache typing-extensions
        w="$(llama_wheel "$p")"
        [ -n "$w" ] || { say "venvs: no cross-built wheel for $p yet (run the llama stage)"; continue; }
        rm -rf "$rootfs/wheels/$p"; mkdir -p "$rootfs/wheels/$p"; cp "$w" "$rootfs/wheels/$p/"
        in_pi PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels -- "/opt/check-$p/bin/pip" install -q --force-reinstall \
            --no-deps "/wheels/$p/$(basename "$w")" "/wheels/$(cd "$rootfs/wheels" && ls edgerun-*.whl | head -1)"
    done
fi

# --- checks --------------------------------------------------------------------------------------
strip_times() {   # the JSON of `edgerun generate --json` without any timing (emulated time means nothing)
    "$py" -c 'import json, sys; d = json.load(sys.stdin)
print(json.dumps({k: d[k] for k in ("model", "draft", "text", "n_tokens", "n_drafted", "n_accepted", "finish_reason")}))'
}
gen_args=(--model smollm2-135m-instruct --no-pull --temperature 0 --json)
GEN_PROMPT="The Python programming language is"
SPEC_PROMPT="$(printf 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')"   # drafts both accepted and rejected
# the CPU qemu emulates for each board: its real core, so an instruction the core lacks traps (SIGILL)
qemu_cpu() { case "$1" in rpi5-*) echo cortex-a76 ;; rpi4-*) echo cortex-a72 ;; *) echo max ;; esac; }
if want checks; then
    say "checks: the x86 build on the host"
    EDGERUN_PROFILE=generic-x86_64-cpu "$py" -m edgerun generate "$GEN_PROMPT" "${gen_args[@]}" --draft none \
        --gamma 0 -n 48 --threads 1 | strip_times >"$results/x86.generate.json"
    [ -f "$results/x86.npz" ] || "$py" "$here/pi_checks.py" logits --model "$model" --positions "$positions" \
        --threads 1 --label x86 --out "$results/x86.npz" >/dev/null
    [ -f "$results/exact.npz" ] || nice -n 10 "$py" "$here/pi_checks.py" reference --model "$model" \
        --tokens-from "$results/x86.npz" --out "$results/exact.npz"
    aarch64-linux-gnu-gcc -O3 -shared -fPIC -pthread "$repo/kernels/stream.c" -o "$rootfs/checks/libstream.so"
    arm=()
    for p in $profiles; do
        say "checks: $p (emulated arm64 userspace, llama.cpp cross-built with $p's CMAKE_ARGS)"
        env_p=(EDGERUN_DEVICE_ROOT="/boards/$p" EDGERUN_HOME=/root/.cache/edgerun QEMU_CPU="$(qemu_cpu "$p")")
        er="/opt/check-$p/bin/edgerun"
        in_pi "${env_p[@]}" -- "$er" profile detect --json >"$results/$p.detect.json"
        got="$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["profile"])' "$results/$p.detect.json")"
        [ "$got" = "$p" ] || die "$p: detection inside the emulation chose $got"
        in_pi "${env_p[@]}" -- "$er" generate "$GEN_PROMPT" "${gen_args[@]}" --draft none --gamma 0 -n 48 \
            --threads 2 | strip_times >"$results/$p.generate.json"
        for d in none lookup; do
            in_pi "${env_p[@]}" -- "$er" generate "$SPEC_PROMPT" "${gen_args[@]}" --draft "$d" --gamma 4 -n 64 \
                --threads 1 | strip_times >"$results/$p.spec-$d.json"
        done
        if [ ! -s "$results/$p.build.json" ] || [ ! -f "$results/$p.npz" ]; then
            in_pi "${env_p[@]}" -- "/opt/check-$p/bin/python" /checks/pi_checks.py logits --model \
                "/root/.cache/edgerun/models/$(basename "$model")" --positions "$positions" --threads 2 \
                --label "$p" --out "/checks/$p.npz" >"$results/$p.build.json"
            cp "$rootfs/checks/$p.npz" "$results/$p.npz"
        fi
        in_pi "${env_p[@]}" -- "/opt/check-$p/bin/python" /checks/pi_checks.py kernel --lib /checks/libstream.so \
            >"$results/$p.kernel.json"
        arm+=(--arm "$p=$results/$p.npz")
        if [ "$(qemu_cpu "$p")" = cortex-a76 ]; then
            # the same build on a Pi 4's core must trap: the dotprod/fp16 kernels are really compiled in and run
            rc=0
            in_pi "${env_p[@]}" QEMU_CPU=cortex-a72 -- "$er" generate "$GEN_PROMPT" "${gen_args[@]}" --draft none \
                --gamma 0 -n 2 --threads 1 >"$results/$p.on-cortex-a72.log" 2>&1 || rc=$?
            echo "exit status $rc" >>"$results/$p.on-cortex-a72.log"
            say "checks: the $p build on an emulated Cortex-A72 exits with status $rc (132 = SIGILL expected)"
        fi
    done
    "$py" - "$results" $profiles <<'EOF'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
x86 = json.loads((res / "x86.generate.json").read_text())
print(f"x86 greedy: {x86['text']!r}")
ok = True
for p in sys.argv[2:]:
    g = json.loads((res / f"{p}.generate.json").read_text())
    none = json.loads((res / f"{p}.spec-none.json").read_text())
    look = json.loads((res / f"{p}.spec-lookup.json").read_text())
    build = json.loads((res / f"{p}.build.json").read_text())
    kern = json.loads((res / f"{p}.kernel.json").read_text())
    same = look["text"] == none["text"]
    ok &= same and look["n_accepted"] > 0
    print(f"{p}: libs {sorted(set(build['libs'].values()))}; ggml: {build['system_info']}")
    print(f"{p} greedy ({'same as' if g['text'] == x86['text'] else 'DIFFERS from'} x86): {g['text']!r}")
    print(f"{p} lookup speculative == plain greedy at 1 thread: {same} "
          f"({look['n_accepted']} of {look['n_drafted']} drafted tokens accepted over {look['n_tokens']} tokens)")
    print(f"{p} bandwidth kernel: {kern['lib_machine']} library, checksum {kern['checksum']}")
sys.exit(0 if ok else 1)
EOF
    "$py" "$here/pi_checks.py" compare --x86 "$results/x86.npz" --reference "$results/exact.npz" "${arm[@]}" \
        --out "$results/compare.json"
fi

# --- install: deploy/install.sh inside the rootfs ------------------------------------------------
if want install; then
    p="${profiles%% *}"
    w="$(llama_wheel "$p")"
    say "install: deploy/install.sh in the emulated $p (llama.cpp build replaced by $(basename "$w"))"
    rm -rf "$rootfs/src/edgerun"; mkdir -p "$rootfs/src/edgerun"
    git -C "$repo" archive HEAD | tar -x -C "$rootfs/src/edgerun"
    rm -rf "$rootfs/etc/edgerun" "$rootfs/etc/systemd/system/edgerun.service"   # the venv stays: install.sh reuses it
    in_pi PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels -- bash /src/edgerun/deploy/install.sh --root "/boards/$p" \
        --source /src/edgerun --llama-wheel "/wheels/$p/$(basename "$w")" --no-start 2>&1 | tee "$results/install.log"
    in_pi -- systemd-analyze verify /etc/systemd/system/edgerun.service 2>&1 | tee "$results/install.verify.log"
    say "install: the unit passes systemd-analyze verify inside the emulated $p"
    in_pi -- cat /etc/edgerun/edgerun.env | grep '^EDGERUN_PROFILE='
fi

# --- bundle: `edgerun bundle` here, its install.sh and the unit's ExecStart in the rootfs, no network ----
if want bundle; then
    p="${profiles%% *}"
    w="$(llama_wheel "$p")"
    [ -n "$w" ] || die "bundle: no cross-built llama-cpp-python wheel for $p (run the llama stage)"
    [ -x "$rootfs/usr/bin/python3" ] || die "bundle: no rootfs (run the rootfs stage)"
    mount_in proc /proc -t proc
    mount_in /dev /dev --bind
    pyver="$(in_pi -- python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    qcpu="$(qemu_cpu "$p")"
    out="$work/bundle-$p"
    rm -f "$results"/bundle.*
    # (1) the bundle, made from scratch here (x86-64, with the package index), timed
    say "bundle: edgerun bundle --profile $p --model $bundle_model --python $pyver --llama-wheel $(basename "$w")"
    rm -rf "$out"
    /usr/bin/time -f '%e' -o "$results/bundle.time" nice -n 10 "$py" -m edgerun bundle --profile "$p" \
        --model "$bundle_model" --python "$pyver" --llama-wheel "$w" -o "$out" 2>&1 | tee "$results/bundle.log"
    [ -f "$out/manifest.json" ] || die "bundle: edgerun bundle made no $out/manifest.json"

    # (2) a fresh install (no earlier /opt/edgerun) in the rootfs: its install.sh as root in a network
    # namespace with no interfaces, so pip (--no-index) and everything else can reach nothing; first, in
    # the same namespace, the interfaces (loopback only, down) and a request to the package index that
    # must fail go to results/bundle.netns.txt
    say "bundle: install.sh in the emulated $p (QEMU_CPU=$qcpu), in unshare -n (no network)"
    rm -rf "$rootfs/root/bundle" "$rootfs/opt/edgerun" "$rootfs/etc/edgerun" "$rootfs/var/cache/edgerun" \
        "$rootfs/var/lib/edgerun" "$rootfs/etc/systemd/system/edgerun.service"
    cp -a "$out" "$rootfs/root/bundle"
    # shellcheck disable=SC2016
    /usr/bin/time -f '%e' -o "$results/bundle.install.time" unshare -n bash -c '
        { ip -o link; curl -sS --max-time 5 -o /dev/null https://pypi.org/simple/ 2>&1 && exit 3; } >"$1"
        shift; exec chroot "$@"' _ "$results/bundle.netns.txt" "$rootfs" /usr/bin/env -i \
        HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
        QEMU_CPU="$qcpu" bash /root/bundle/install.sh --offline 2>&1 | tee "$results/bundle.install.log"
    [ -L "$rootfs/opt/edgerun/venv" ] || die "bundle: install.sh left no /opt/edgerun/venv link"

    # (3) the installed unit's ExecStart as systemd would run it, as far as a chroot allows: its
    # Environment= then EnvironmentFile= (the file wins), %C=/var/cache, %S=/var/lib, WorkingDirectory=.
    # No systemd, so no DynamicUser=: the service runs as nobody (65534), which owns the cache and state
    # directories as CacheDirectory=/StateDirectory= hand them to the dynamic user (chown, links included).
    eval "$("$py" "$here/unit_exec.py" "$rootfs" /etc/systemd/system/edgerun.service)"   # wd, svc_env, svc_cmd
    port=8080; for e in "${svc_env[@]}"; do case "$e" in EDGERUN_PORT=*) port="${e#*=}" ;; esac; done
    say "bundle: ExecStart=${svc_cmd[*]} in $wd, ${#svc_env[@]} variables (unit + env file), as nobody"
    mkdir -p "$rootfs/var/cache/edgerun" "$rootfs$wd"
    chown -R -h 65534:65534 "$rootfs/var/cache/edgerun" "$rootfs$wd"
    # server and client in one network namespace with only loopback up: the server under qemu in the
    # chroot, the client (curl) on the host side of the same namespace. Run twice: the first start (it
    # hashes the model and probes the costs, caching both in EDGERUN_HOME) and a second one (a reboot's)
    {
        echo 'set -euo pipefail'
        echo 'n="${1:?}"   # 1: the first start, 2: the second'
        printf 'res=%q\nmodel=%q\n' "$results" "$bundle_model"
        echo 'ip link set lo up'
        echo 't0=$(date +%s.%N)'
        printf 'chroot --userspec=65534:65534 %q /usr/bin/env -i -C %q QEMU_CPU=%q PATH=/usr/sbin:/usr/bin:/sbin:/bin' \
            "$rootfs" "$wd" "$qcpu"
        printf ' %q' "${svc_env[@]}" "${svc_cmd[@]}"
        echo ' >"$res/bundle.serve$n.log" 2>&1 &'
        echo 'pid=$!'
        echo "trap 'kill \$pid 2>/dev/null || true; wait \$pid 2>/dev/null || true' EXIT"
        echo "url=http://127.0.0.1:$port"
        cat <<'SH'
for _ in $(seq 1 1200); do
    curl -sf "$url/health" >"$res/bundle.health$n.json" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "the service exited:"; tail -20 "$res/bundle.serve$n.log"; exit 1; }
    sleep 1
done
curl -sf "$url/health" >/dev/null || { echo "no /health ok after 1200 s"; tail -20 "$res/bundle.serve$n.log"; exit 1; }
t1=$(date +%s.%N)
curl -sS --fail-with-body "$url/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "'"$model"'", "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 24, "temperature": 0}' >"$res/bundle.chat$n.json"
t2=$(date +%s.%N)
echo "$t0 $t1 $t2" >"$res/bundle.serve$n.times"
SH
    } >"$work/bundle-serve.sh"
    say "bundle: the service in unshare -n (loopback only); waiting for /health, then one chat completion"
    unshare -n bash "$work/bundle-serve.sh" 1
    say "bundle: the service's second start (hashes and cost probes cached), one chat completion"
    unshare -n bash "$work/bundle-serve.sh" 2
    "$py" "$here/bundle_report.py" --bundle "$out" --results "$results" --profile "$p" --model "$bundle_model" \
        --python "$pyver" --qemu-cpu "$qcpu" --llama-wheel "$(basename "$w")"
fi
