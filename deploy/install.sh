#!/usr/bin/env bash
# Install edgerun as a systemd service on this board.
#
#   sudo deploy/install.sh [--dry-run] [--profile NAME] [--prefix /opt/edgerun] [--source DIR|SPEC]
#                          [--llama-wheel FILE]
#   sudo deploy/install.sh --worker [--authorize-key HEAD_KEY.pub] [...]   # a board that lends its memory
#   sudo deploy/install.sh --tunnel HOST [--local-port N] [--remote-port N] # on the head, once per worker
#
# Steps: create a venv under PREFIX; install edgerun's light dependencies and edgerun itself;
# detect the board (`edgerun service build-flags`, i.e. the device profile); build llama-cpp-python
# from source with that profile's CMAKE_ARGS (CUDA on Jetson, Metal on Apple, NEON on a Pi), or
# install a wheel already built with them (--llama-wheel: e.g. cross-built for a fleet of Pis);
# install the rest; write /etc/edgerun/edgerun.env (kept if it exists) and the unit
# (`edgerun service print`); systemctl daemon-reload, enable and (re)start the service.
# llama-cpp-python is always built with llama.cpp's RPC backend (-DGGML_RPC=on) so any board can be a
# head or a worker of a split model (docs/cluster.md). --worker installs edgerun-worker.service instead
# of the server (loopback only) and an account for heads' tunnels; --tunnel HOST installs, on a head,
# edgerun-tunnel@HOST (an SSH forward with a key of its own) and prints the line HOST must authorize.
# --dry-run prints every step without doing any of it (nothing is created or changed).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dry=0
prefix=/opt/edgerun
etc_dir=/etc/edgerun
unit_dir=/etc/systemd/system
source_spec="$(dirname "$here")"
profile=auto
python=python3
start=1
root=/
llama_wheel=""
offline=0
mode=server
authorize_key=""
tunnel_host=""
local_port=50052
remote_port=50052
ssh_user=edgerun-tunnel
ssh_port=22

usage() {
    cat <<EOF
usage: install.sh [options]
  --dry-run          print every step, do nothing
  --profile NAME     device profile (default: auto = detect this board)
  --prefix DIR       install root; the venv goes to DIR/venv (default /opt/edgerun)
  --etc-dir DIR      where edgerun.env goes (default /etc/edgerun)
  --unit-dir DIR     where edgerun.service goes (default /etc/systemd/system)
  --source SRC       edgerun to install: a source directory (default: this checkout) or a pip
                     requirement such as 'edgerun[serve]==0.1.0'
  --python PY        Python (>= 3.10) that creates the venv (default python3)
  --no-start         enable the service but do not (re)start it now
  --offline          systemd is not running (a chroot, an image build): enable the unit in the
                     file system only (automatic when /run/systemd/system is missing)
  --llama-wheel FILE install this llama-cpp-python wheel instead of building it here (one built
                     with the board profile's CMAKE_ARGS, e.g. by bench/boards/emulate_pi.sh)
  --root DIR         read the board identity files under DIR instead of / (tests, emulation;
                     exported as EDGERUN_DEVICE_ROOT, so edgerun's own detection reads there too)
  --worker           install the RPC worker (edgerun-worker.service, loopback only) instead of the server
  --authorize-key F  with --worker: let the head whose tunnel key is F (a .pub) forward to the worker port
                     only (authorized_keys of the '$ssh_user' account: restrict,port-forwarding,permitopen)
  --tunnel HOST      on a head: the SSH tunnel to the worker on HOST (edgerun-tunnel@HOST, its own key)
  --local-port N     --tunnel: port on this head's loopback (default 50052; one per worker)
  --remote-port N    --tunnel / --authorize-key: the worker's port (default 50052)
  --ssh-user U       --tunnel / --worker: account on the worker that takes tunnels (default $ssh_user)
  --ssh-port N       --tunnel: the worker's SSH port (default 22)
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --profile) profile="${2:?--profile needs a value}"; shift ;;
        --prefix) prefix="${2:?--prefix needs a value}"; shift ;;
        --etc-dir) etc_dir="${2:?--etc-dir needs a value}"; shift ;;
        --unit-dir) unit_dir="${2:?--unit-dir needs a value}"; shift ;;
        --source) source_spec="${2:?--source needs a value}"; shift ;;
        --python) python="${2:?--python needs a value}"; shift ;;
        --no-start) start=0 ;;
        --offline) offline=1 ;;
        --root) root="${2:?--root needs a value}"; shift ;;
        --llama-wheel) llama_wheel="${2:?--llama-wheel needs a value}"; shift ;;
        --worker) mode=worker ;;
        --authorize-key) authorize_key="${2:?--authorize-key needs a value}"; shift ;;
        --tunnel) mode=tunnel; tunnel_host="${2:?--tunnel needs a HOST}"; shift ;;
        --local-port) local_port="${2:?--local-port needs a value}"; shift ;;
        --remote-port) remote_port="${2:?--remote-port needs a value}"; shift ;;
        --ssh-user) ssh_user="${2:?--ssh-user needs a value}"; shift ;;
        --ssh-port) ssh_port="${2:?--ssh-port needs a value}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

if [ "$root" != / ]; then export EDGERUN_DEVICE_ROOT="$root"; fi

venv="$prefix/venv"
env_file="$etc_dir/edgerun.env"
unit_file="$unit_dir/edgerun.service"

say() { printf '==> %s\n' "$*"; }
# run CMD...: run it, or in a dry run print it (shell-quoted) instead.
run() {
    if [ "$dry" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}
# write_file DEST MODE: write stdin to DEST atomically (temp file in the same dir + rename),
# or in a dry run print what would be written.
write_file() {
    local dest="$1" mode="$2" tmp
    if [ "$dry" = 1 ]; then
        printf '+ write %s (mode %s):\n' "$dest" "$mode"
        sed 's/^/    | /'
        return
    fi
    tmp="$(mktemp "$dest.XXXXXX")"
    cat >"$tmp"
    chmod "$mode" "$tmp"
    sync "$tmp"
    mv -f "$tmp" "$dest"
}

os="$(uname -s)"
if [ "$dry" = 0 ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (it writes $prefix, $etc_dir and $unit_dir), or use --dry-run" >&2
    exit 2
fi
for v in "$local_port" "$remote_port" "$ssh_port"; do
    case "$v" in ''|*[!0-9]*) echo "install.sh: port $v is not a number" >&2; exit 2 ;; esac
done
if [ -n "$authorize_key" ] && [ "$mode" != worker ]; then
    echo "install.sh: --authorize-key goes with --worker (run it on the worker board)" >&2; exit 2
fi

# --- a head's SSH tunnel to one worker (no venv needed: ssh only) -----------------------------------
if [ "$mode" = tunnel ]; then
    case "$tunnel_host" in
        ''|-*|*[!A-Za-z0-9.:_-]*) echo "install.sh: --tunnel $tunnel_host is not a host name or address" >&2; exit 2 ;;
    esac
    tdir="$etc_dir/tunnel"
    say "SSH tunnel 127.0.0.1:$local_port -> $tunnel_host:127.0.0.1:$remote_port (edgerun-tunnel@$tunnel_host)"
    run mkdir -p -m 0700 "$tdir"
    if [ -e "$tdir/id_ed25519" ]; then
        say "keeping the existing tunnel key $tdir/id_ed25519"
    else
        run ssh-keygen -q -t ed25519 -N "" -C "edgerun-head@$(hostname)" -f "$tdir/id_ed25519"
    fi
    printf 'SSH_USER=%s\nSSH_PORT=%s\nLOCAL_PORT=%s\nREMOTE_PORT=%s\n' "$ssh_user" "$ssh_port" "$local_port" \
        "$remote_port" | write_file "$tdir/$tunnel_host.env" 0600
    if [ "$dry" = 0 ] && ! ssh-keygen -F "$tunnel_host" -f "$tdir/known_hosts" >/dev/null 2>&1; then
        say "recording $tunnel_host's host key (compare its fingerprint with the worker's: ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub)"
        ssh-keyscan -p "$ssh_port" -t ed25519 "$tunnel_host" 2>/dev/null >>"$tdir/known_hosts"
        ssh-keygen -lf "$tdir/known_hosts" | grep -F "$tunnel_host" || true
    fi
    run mkdir -p "$unit_dir"
    sed "s#/etc/edgerun/#$etc_dir/#g" "$here/edgerun-tunnel@.service" | write_file "$unit_dir/edgerun-tunnel@.service" 0644
    # A head whose workers are away (rebooting) fails its start-up check (exit 2): keep retrying every
    # 10 s instead of giving up after the unit's 5 starts in 10 min.
    run mkdir -p "$unit_dir/edgerun.service.d"
    printf '[Unit]\nStartLimitIntervalSec=0\n\n[Service]\nRestartSec=10s\n' | \
        write_file "$unit_dir/edgerun.service.d/20-cluster.conf" 0644
    say "on $tunnel_host, authorize this head (the key may open 127.0.0.1:$remote_port and nothing else):"
    say "  sudo deploy/install.sh --worker --authorize-key edgerun-head.pub   # with this file's content:"
    if [ "$dry" = 0 ]; then cat "$tdir/id_ed25519.pub"; else say "  (the public key $tdir/id_ed25519.pub)"; fi
    say "then add 127.0.0.1:$local_port to EDGERUN_RPC in $etc_dir/edgerun.env"
    if [ "$offline" = 1 ] || { [ "$dry" = 0 ] && [ ! -d /run/systemd/system ]; }; then
        run systemctl --root=/ enable "edgerun-tunnel@$tunnel_host.service"
        exit 0
    fi
    run systemctl daemon-reload
    run systemctl enable "edgerun-tunnel@$tunnel_host.service"
    [ "$start" = 1 ] && run systemctl restart "edgerun-tunnel@$tunnel_host.service"
    exit 0
fi
if ! "$python" -c 'import sys, venv; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    if [ "$dry" = 1 ]; then
        say "note: $python is not a Python >= 3.10 with the venv module; the real install would stop here"
    else
        echo "install.sh: $python must be Python >= 3.10 with the venv module (Debian: apt-get install python3-venv)" >&2
        exit 2
    fi
fi

if [ -d "$source_spec" ]; then
    [ -f "$source_spec/pyproject.toml" ] || { echo "install.sh: $source_spec has no pyproject.toml" >&2; exit 2; }
    pkg="$source_spec"
    pkg_serve="$source_spec[serve]"
else
    pkg="$source_spec"
    pkg_serve="$source_spec"
fi

# --- 1. the venv and edgerun's light dependencies (enough to detect the board) ------------------
say "venv in $venv"
run mkdir -p "$prefix"
run "$python" -m venv "$venv"
run "$venv/bin/python" -m pip install --upgrade pip
run "$venv/bin/python" -m pip install click pyyaml psutil
run "$venv/bin/python" -m pip install --no-deps "$pkg"

# --- 2. the board and its build flags ------------------------------------------------------------
# From the device profile (device_profiles/*.yaml, field build.cmake_args). A dry run
# has no venv yet: it asks $python with the source tree on PYTHONPATH, and falls back to reading
# the board files and the profile YAML directly.
flags_json=""
if [ "$dry" = 1 ]; then
    if [ -d "$source_spec" ]; then
        flags_json="$(PYTHONPATH="$source_spec${PYTHONPATH:+:$PYTHONPATH}" \
            "$python" -m edgerun service build-flags --profile "$profile" 2>/dev/null)" || flags_json=""
    fi
else
    flags_json="$("$venv/bin/python" -m edgerun service build-flags --profile "$profile")"
fi

json_field() {   # json_field KEY: a string field of $flags_json ('' if absent)
    "$python" -c 'import json, sys; v = json.loads(sys.argv[1]).get(sys.argv[2]); print("" if v is None else v)' \
        "$flags_json" "$1"
}

build_env=()
if [ -n "$flags_json" ]; then
    board="$(json_field profile)"
    reason="$(json_field reason)"
    cmake_args="$(json_field cmake_args)"
    llama_pin="$(json_field llama_cpp_python)"
    while IFS= read -r kv; do
        [ -n "$kv" ] && build_env+=("$kv")
    done < <("$python" -c 'import json, sys; [print(f"{k}={v}") for k, v in json.loads(sys.argv[1])["env"].items()]' "$flags_json")
else
    # Fallback without Python packages: the same identity files profile.detect() reads.
    model_file="$root/proc/device-tree/model"
    board_model="$( [ -r "$model_file" ] && tr -d '\0' <"$model_file" || true)"
    if [ "$profile" != auto ]; then
        board="$profile"; reason="chosen explicitly"
    elif [ "$os" = Darwin ]; then
        board=apple-m1; reason="macOS (Apple Silicon); name the exact chip with --profile"
    elif [ -e "$root/etc/nv_tegra_release" ] || printf '%s' "$board_model" | grep -qi jetson; then
        board=jetson-orin-nano-8gb; reason="NVIDIA Tegra board; name the exact module with --profile"
    elif printf '%s' "$board_model" | grep -q "Raspberry Pi 5"; then
        board=rpi5-8gb; reason="device tree: $board_model"
    elif printf '%s' "$board_model" | grep -q "Raspberry Pi 4"; then
        board=rpi4-8gb; reason="device tree: $board_model"
    else
        case "$(uname -m)" in
            aarch64|arm64) board=generic-arm64-cpu ;;
            *) board=generic-x86_64-cpu ;;
        esac
        reason="no board-specific profile matched; generic profile by machine $(uname -m)"
    fi
    yaml="$source_spec/device_profiles/$board.yaml"
    if [ ! -f "$yaml" ]; then
        echo "install.sh: no device profile $board ($yaml); expected one of device_profiles/*.yaml" >&2
        exit 2
    fi
    cmake_args="$(sed -n 's/^  cmake_args: *"\(.*\)"$/\1/p' "$yaml")"
    llama_pin="$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' "$source_spec/pyproject.toml" 2>/dev/null | head -1)"
    say "note: board detected without edgerun's Python packages (build env of the profile not read)"
fi
llama_pin="${llama_pin:-0.3.36}"
# llama.cpp's RPC backend on every board (a head and a worker need it; it costs nothing unused)
cmake_args="${cmake_args:+$cmake_args }-DGGML_RPC=on"
say "board: $board ($reason)"
say "llama-cpp-python $llama_pin with CMAKE_ARGS='$cmake_args'"

# --- 2j. Jetson: the CUDA build --------------------------------------------------------------------
# What the profile's CMAKE_ARGS (-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87) need on the board, beyond
# what was compiled off the board (bench/boards/build_cuda.sh: x86-64 host, CUDA 13.0, sm_87; see
# docs/devices.md, "Jetson Orin"):
# - JetPack's own CUDA toolkit: JetPack 6 (L4T r36) ships CUDA 12.x (12.2 .. 12.6), JetPack 5 (r35) CUDA
#   11.4; nvcc at /usr/local/cuda/bin/nvcc (the profile's CUDACXX). `sudo apt install nvidia-jetpack` (or
#   cuda-toolkit-12-6 alone) provides it with cuBLAS. Build with the board's toolkit: the libraries must
#   run on JetPack's driver. The off-board check used CUDA 13.0 (its nvcc targets sm_87 too); whether
#   CUDA 13 code runs on a JetPack 6 driver was NOT CHECKED (that build links libcudart.so.13 and
#   libcublas.so.13; JetPack 6 ships .so.12).
# - reported, not checked: ggml-cuda's 32 GiB VMM address reservation can fail on Orin (out of memory at
#   cuMemAddressReserve with memory free); add -DGGML_CUDA_NO_VMM=ON to CMAKE_ARGS if a load fails there.
# - the build runs ON the board (aarch64, JetPack's libcuda/libcublas) or in an aarch64 sysroot of the
#   same JetPack (as emulate_pi.sh cross-compiles the Pi's CPU build): NOT CHECKED HERE, no JetPack
#   sysroot was at hand. --llama-wheel takes a wheel built either way.
# - it takes long: 95 min for the whole build (144 CUDA sources, sm_87 only) on a shared 2-core x86
#   machine; on the board's cores it was not timed (docs/devices.md).
# After the install the service checks where the layers land (EDGERUN_REQUIRE_GPU=1 makes a CPU-only
# build fatal instead of a warning), and so does the check below.
case "$board" in
    jetson-*)
        nvcc_bin="/usr/local/cuda/bin/nvcc"
        for kv in ${build_env[@]+"${build_env[@]}"}; do
            case "$kv" in CUDACXX=*) nvcc_bin="${kv#CUDACXX=}" ;; esac
        done
        if [ -x "$nvcc_bin" ]; then
            say "CUDA: $("$nvcc_bin" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p') at $nvcc_bin"
        elif [ -z "$llama_wheel" ] && [ "$dry" = 0 ]; then
            echo "install.sh: no CUDA compiler at $nvcc_bin: install JetPack's CUDA toolkit first" \
                 "(sudo apt install nvidia-jetpack), or pass --llama-wheel with a CUDA build;" \
                 "without it llama.cpp would be built for the CPU only" >&2
            exit 2
        else
            say "no CUDA compiler at $nvcc_bin (a dry run, or --llama-wheel given)"
        fi
        ;;
esac

# --- 3. llama-cpp-python built for this board, then the rest of edgerun ---------------------------
if [ -n "$llama_wheel" ]; then
    case "$(basename "$llama_wheel")" in
        llama_cpp_python-"$llama_pin"-*.whl) ;;
        *) echo "install.sh: --llama-wheel $llama_wheel is not a llama_cpp_python-$llama_pin-*.whl" \
                "(edgerun pins llama-cpp-python==$llama_pin)" >&2; exit 2 ;;
    esac
    if [ ! -f "$llama_wheel" ] && [ "$dry" = 0 ]; then
        echo "install.sh: --llama-wheel $llama_wheel does not exist" >&2; exit 2
    fi
    say "llama-cpp-python from $llama_wheel (built elsewhere; it must have been built with the CMAKE_ARGS above)"
    run "$venv/bin/python" -m pip install --no-cache-dir "$llama_wheel"
else
    run env "CMAKE_ARGS=$cmake_args" FORCE_CMAKE=1 ${build_env[@]+"${build_env[@]}"} \
        "$venv/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-python \
        "llama-cpp-python==$llama_pin"
fi
if [ "$mode" = worker ]; then
    run "$venv/bin/python" -m pip install "$pkg"
else
    run "$venv/bin/python" -m pip install "$pkg_serve"
fi
case "$board" in
    jetson-*|apple-*)
        # the build must offload: say so now rather than let the service run on the CPU
        if [ "$dry" = 1 ]; then
            say "would check: $venv/bin/edgerun profile show $board (its GPU devices)"
        elif ! "$venv/bin/python" -c 'import sys; from edgerun import llama_lib; sys.exit(0 if llama_lib.gpu_devices() else 1)'; then
            say "WARNING: the installed llama.cpp sees no GPU: the service would run on the CPU."
            "$venv/bin/edgerun" profile show "$board" | sed -n 's/^\(backend\|device\|PROBLEM\|fix\) */  \1: /p' || true
        fi
        ;;
esac

if [ "$os" != Linux ]; then
    say "installed in $venv; this script sets up systemd services only (not $os):"
    say "run '$venv/bin/edgerun serve' under your service manager"
    exit 0
fi

# --- 4w. a worker: its env file and unit, the account heads' tunnels log in to ----------------------
if [ "$mode" = worker ]; then
    run mkdir -p "$etc_dir"
    if [ -e "$etc_dir/worker.env" ]; then
        say "keeping the existing $etc_dir/worker.env"
    else
        sed "s/^EDGERUN_WORKER_PORT=.*/EDGERUN_WORKER_PORT=$remote_port/" "$here/worker.env" | \
            write_file "$etc_dir/worker.env" 0600
    fi
    run mkdir -p "$unit_dir"
    sed "s#^ExecStart=/opt/edgerun/venv/bin/edgerun worker#ExecStart=$venv/bin/edgerun worker#" \
        "$here/edgerun-worker.service" | write_file "$unit_dir/edgerun-worker.service" 0644
    if [ "$dry" = 1 ] || ! id "$ssh_user" >/dev/null 2>&1; then
        run useradd --system --create-home --home-dir "/var/lib/$ssh_user" --shell /usr/sbin/nologin "$ssh_user"
    fi
    if [ -n "$authorize_key" ]; then
        if [ "$dry" = 0 ]; then
            key="$(head -n1 "$authorize_key")"
            case "$key" in ssh-*|ecdsa-*) ;; *) echo "install.sh: $authorize_key is not an SSH public key" >&2; exit 2 ;; esac
        else
            key="<the head's key from $authorize_key>"
        fi
        home="/var/lib/$ssh_user"
        run install -d -m 0700 -o "$ssh_user" -g "$ssh_user" "$home/.ssh"
        line="restrict,port-forwarding,permitopen=\"127.0.0.1:$remote_port\",command=\"/usr/sbin/nologin\" $key"
        if [ "$dry" = 1 ]; then
            say "would append to $home/.ssh/authorized_keys: $line"
        elif ! grep -qF "$key" "$home/.ssh/authorized_keys" 2>/dev/null; then
            printf '%s\n' "$line" >>"$home/.ssh/authorized_keys"
            chown "$ssh_user:$ssh_user" "$home/.ssh/authorized_keys"; chmod 0600 "$home/.ssh/authorized_keys"
        fi
    fi
    if [ "$offline" = 1 ] || { [ "$dry" = 0 ] && [ ! -d /run/systemd/system ]; }; then
        run systemctl --root=/ enable edgerun-worker.service
        exit 0
    fi
    run systemctl daemon-reload
    run systemctl enable edgerun-worker.service
    [ "$start" = 1 ] && run systemctl restart edgerun-worker.service
    say "worker on 127.0.0.1:$remote_port; check it from the head: edgerun cluster status --rpc 127.0.0.1:PORT"
    exit 0
fi

# --- 4. the environment file (an existing one is kept: it holds the operator's settings) ----------
run mkdir -p "$etc_dir"
if [ -e "$env_file" ]; then
    say "keeping the existing $env_file"
else
    sed "s/^EDGERUN_PROFILE=auto$/EDGERUN_PROFILE=$board/" "$here/edgerun.env" | write_file "$env_file" 0600
fi

# --- 5. the unit (and GPU device access on Jetson) --------------------------------------------------
run mkdir -p "$unit_dir"
if [ "$dry" = 1 ]; then
    unit_text=""
    if [ -d "$source_spec" ]; then
        unit_text="$(PYTHONPATH="$source_spec${PYTHONPATH:+:$PYTHONPATH}" "$python" -m edgerun service print \
            --env-file "$env_file" --exec-start "$venv/bin/edgerun serve" --profile "$board" 2>/dev/null)" \
            || unit_text=""
    fi
    if [ -n "$unit_text" ]; then
        printf '%s\n' "$unit_text" | write_file "$unit_file" 0644
    else
        say "would write $unit_file from: $venv/bin/edgerun service print --env-file $env_file"
    fi
else
    "$venv/bin/edgerun" service print --env-file "$env_file" --profile "$board" | write_file "$unit_file" 0644
fi
case "$board" in
    jetson-*)
        # The unit of a Jetson profile names SupplementaryGroups=video render and DeviceAllow= for the GPU
        # device nodes (edgerun/serve/systemd.py): DynamicUser's user gets no groups otherwise, and the
        # unit's ProtectClock= closes the device cgroup to all but the listed nodes. systemd refuses to
        # start a unit whose group does not exist: create a missing one (empty; udev's rules name it).
        for g in video render; do
            if ! getent group "$g" >/dev/null; then run groupadd --system "$g"; fi
        done
        # an older install's drop-in granted the groups alone; the unit itself does it now
        [ -e "$unit_file.d/10-gpu.conf" ] && run rm -f "$unit_file.d/10-gpu.conf"
        ;;
esac

# --- 6. systemd ------------------------------------------------------------------------------------
# Offline (--offline, or systemd not running here: a chroot, an image being built): enable the unit
# in the file system only; it starts at the next boot.
if [ "$offline" = 0 ] && [ "$dry" = 0 ] && [ ! -d /run/systemd/system ]; then
    say "systemd is not running here (no /run/systemd/system): installing offline"
    offline=1
fi
if [ "$offline" = 1 ]; then
    run systemctl --root=/ enable edgerun.service
    say "enabled offline; edgerun.service starts at the next boot of this system"
    exit 0
fi
run systemctl daemon-reload
run systemctl enable edgerun.service
if [ "$start" = 1 ]; then
    run systemctl restart edgerun.service
    say "started; follow it with: journalctl -u edgerun -f   (ready when: curl -s localhost:8080/health)"
else
    say "enabled; start it with: systemctl start edgerun"
fi
