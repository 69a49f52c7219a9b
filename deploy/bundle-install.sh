#!/usr/bin/env bash
# Install edgerun on a board with no network, from a bundle made by `edgerun bundle` (this file is the
# bundle's install.sh; docs/deploy.md). Nothing is downloaded: pip runs with --no-index.
#
#   sudo ./install.sh [--dry-run] [--prefix /opt/edgerun] [--no-start]
#
# Order: (1) refuse a board of another Python or CPU architecture (or an older glibc) up front;
# (2) verify every file of the bundle against manifest.json (size + sha256; a missing, corrupt or
# unlisted file stops here, before anything is touched); (3) a NEW venv PREFIX/venvs/<version>-<time>,
# filled from the bundle's wheels; (4) the models into PREFIX/models (world-readable) and links to them
# in the service's cache (EDGERUN_HOME of the unit: /var/cache/edgerun); hub models (hf:...) into PREFIX/hub,
# linked the same way, with their records (place_hub.py), each then resolved from the cache offline; (5) PREFIX/venv, a symlink,
# switched to the new venv in one rename (a failed install leaves the previous version as it was);
# (6) /etc/edgerun/edgerun.env written only if absent; the unit rendered by the new venv's
# `edgerun service print`; (7) systemctl daemon-reload, enable, restart (only where systemd runs).
set -Eeuo pipefail      # -E: the ERR trap of the venv step also fires inside run()

umask 022                            # the venv and models must be readable by the service's DynamicUser
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dry=0
prefix=/opt/edgerun
etc_dir=/etc/edgerun
unit_dir=/etc/systemd/system
cache_dir=/var/cache/edgerun         # the unit's EDGERUN_HOME (%C/edgerun)
python=python3
start=1
offline=0
keep=2                               # earlier venvs kept for a manual roll-back

usage() {
    cat <<EOF
usage: install.sh [options]        (run as root; no network needed)
  --dry-run          check the board and verify the bundle, then print every step without doing it
  --prefix DIR       install root: DIR/venv (a symlink), DIR/venvs/, DIR/models/ (default /opt/edgerun)
  --etc-dir DIR      where edgerun.env goes; an existing one is kept (default /etc/edgerun)
  --unit-dir DIR     where edgerun.service goes (default /etc/systemd/system)
  --cache-dir DIR    the service's EDGERUN_HOME, where the models are linked (default /var/cache/edgerun)
  --python PY        the board's Python that creates the venv (default python3)
  --no-start         enable the service but do not (re)start it now
  --offline          systemd is not running (a chroot, an image build): write the unit, start nothing
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --prefix) prefix="${2:?--prefix needs a value}"; shift ;;
        --etc-dir) etc_dir="${2:?--etc-dir needs a value}"; shift ;;
        --unit-dir) unit_dir="${2:?--unit-dir needs a value}"; shift ;;
        --cache-dir) cache_dir="${2:?--cache-dir needs a value}"; shift ;;
        --python) python="${2:?--python needs a value}"; shift ;;
        --no-start) start=0 ;;
        --offline) offline=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
for d in prefix etc_dir unit_dir cache_dir; do
    case "${!d}" in /*) ;; *) echo "install.sh: --${d//_/-} ${!d} must be an absolute path" >&2; exit 2 ;; esac
done

say() { printf '==> %s\n' "$*"; }
die() { echo "install.sh: $*" >&2; exit 2; }
run() {   # run CMD...: run it, or in a dry run print it
    if [ "$dry" = 1 ]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
write_file() {   # write_file DEST MODE < content: atomic (temp file beside DEST + rename); printed in a dry run
    local dest="$1" mode="$2" tmp
    if [ "$dry" = 1 ]; then printf '+ write %s (mode %s):\n' "$dest" "$mode"; sed 's/^/    | /'; return; fi
    tmp="$(mktemp "$dest.XXXXXX")"
    cat >"$tmp"
    chmod "$mode" "$tmp"
    sync "$tmp"
    mv -f "$tmp" "$dest"
}

[ -f "$here/manifest.json" ] || die "no manifest.json beside install.sh in $here: run the install.sh of an unpacked bundle"
if [ "$dry" = 0 ] && [ "$(id -u)" != 0 ]; then
    for d in "$prefix" "$etc_dir" "$unit_dir" "$cache_dir"; do
        p="$d"; while [ ! -e "$p" ]; do p="$(dirname "$p")"; done
        [ -w "$p" ] || die "run as root (it writes $prefix, $etc_dir, $unit_dir and $cache_dir), or use --dry-run"
    done
fi

# --- 1. this board: the bundle's Python, architecture and glibc, or a refusal before anything else ----
command -v "$python" >/dev/null 2>&1 || die "no $python here; the bundle needs the board's CPython (Debian: apt-get install python3 python3-venv)"
# shellcheck disable=SC2016
checks="$("$python" - "$here/manifest.json" <<'PY'
import json, platform, sys
m = json.load(open(sys.argv[1]))
if m.get("format") != 1:
    sys.exit(f"manifest.json has format {m.get('format')!r}; this install.sh reads format 1")
t = m["target"]
mach = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
have = "%d.%d" % sys.version_info[:2]
errors = []
if have != t["python"]:
    errors.append(f"the bundle is for CPython {t['python']}, this board's {sys.executable} is {have}: make a bundle "
                  f"with `edgerun bundle --python {have}`")
if mach != t["machine"]:
    errors.append(f"the bundle is for {t['machine']}, this board is {mach}: make a bundle with its profile")
lib, ver = platform.libc_ver()
if lib == "glibc" and tuple(map(int, ver.split(".")[:2])) < tuple(map(int, t["glibc"].split("."))):
    errors.append(f"the bundle's wheels need glibc >= {t['glibc']}, this board has {ver}: make a bundle with "
                  f"`edgerun bundle --glibc {ver}`")
if errors:
    sys.exit("\n".join(errors))
print(m["edgerun"], m["profile"], m["model"], t["python"], t["machine"], " ".join(e for e in m.get("extras", [])))
PY
)" || die "this board cannot take the bundle (nothing was installed)"
read -r version profile model pyver machine extras <<<"$checks"
"$python" -c 'import venv, ensurepip' 2>/dev/null || die "$python has no venv/ensurepip module (Debian: apt-get install python3-venv; the bundle cannot fetch it)"
say "bundle: edgerun $version for $profile (CPython $pyver, $machine); this board matches"

# --- 2. every file of the bundle, before anything is touched --------------------------------------------
"$python" - "$here" "$prefix" <<'PY' || die "the bundle is damaged or does not fit (nothing was installed)"
import hashlib, json, os, shutil, sys
root, prefix = sys.argv[1], sys.argv[2]
m = json.load(open(os.path.join(root, "manifest.json")))
listed = {f["path"]: f for f in m["files"]}
bad = []
total = 0
for rel, f in listed.items():
    p = os.path.join(root, rel)
    if not os.path.isfile(p):
        bad.append(f"{rel}: missing")
        continue
    if os.path.getsize(p) != f["size"]:
        bad.append(f"{rel}: {os.path.getsize(p)} bytes, the manifest says {f['size']} (truncated or changed)")
        continue
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != f["sha256"]:
        bad.append(f"{rel}: sha256 {h.hexdigest()} does not match the manifest's {f['sha256']} (corrupt)")
    total += f["size"]
for sub in ("wheels", "models", "hub"):     # pip and the model copy take whatever is there: only listed files
    for top, dirs, names in sorted(os.walk(os.path.join(root, sub))):
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(top, name), root).replace(os.sep, "/")
            if rel not in listed:
                bad.append(f"{rel}: not in the manifest (remove it)")
if bad:
    sys.exit("\n".join(f"install.sh: {b}" for b in bad))
print(f"==> verified {len(listed)} files ({total / 1e6:.1f} MB) against manifest.json")
# room under PREFIX: the models, and a venv (unpacked wheels: about 4x their size, measured 3.9x)
def installed(rel, size):                  # a model an earlier install already placed (an upgrade)
    q = os.path.join(prefix, rel)
    return os.path.isfile(q) and os.path.getsize(q) == size
need = sum(f["size"] for r, f in listed.items() if r.startswith(("models/", "hub/")) and not installed(r, f["size"])) \
    + 4 * sum(f["size"] for r, f in listed.items() if r.startswith("wheels/"))
p = prefix
while not os.path.exists(p):
    p = os.path.dirname(p)
free = shutil.disk_usage(p).free
if free < need:
    sys.exit(f"install.sh: {prefix} needs about {need / 1e6:.0f} MB free, {p} has {free / 1e6:.0f} MB")
PY

stamp="$(date -u +%Y%m%d-%H%M%S)-$$"
new="$prefix/venvs/edgerun-$version-$stamp"
req="edgerun==$version"
[ -n "$extras" ] && req="edgerun[${extras// /,}]==$version"

# --- 3. a new venv from the bundle's wheels (the running version is not touched) ------------------------
say "venv $new (pip --no-index from $here/wheels)"
run mkdir -p "$prefix/venvs"
cleanup_new() { [ "$dry" = 1 ] || rm -rf "$new"; }
trap 'cleanup_new; echo "install.sh: failed; the previous version (if any) is unchanged" >&2' ERR
run "$python" -m venv "$new"
# A clean environment: no PIP_* variables or pip.conf of this machine can add an index or other wheels.
run env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_CONFIG_FILE=/dev/null PIP_NO_INPUT=1 \
    "$new/bin/python" -m pip install --no-index --find-links "$here/wheels" --no-cache-dir \
    --disable-pip-version-check -q "$req"
# the native library loads on this board (a wheel built for another CPU fails here, not in the service)
run "$new/bin/python" -c 'import edgerun, llama_cpp; print("==> edgerun", edgerun.__version__, "and llama.cpp load")'
# the unit, rendered by the new version (its ExecStart goes through the PREFIX/venv link)
unit_text=""
if [ "$dry" = 0 ]; then
    unit_text="$("$new/bin/edgerun" service print --env-file "$etc_dir/edgerun.env" \
        --exec-start "$prefix/venv/bin/edgerun serve" --profile "$profile")"
fi
trap - ERR

resolve_check='import json, sys
from edgerun.resolve import resolve_model
for m in json.load(open(sys.argv[1]))["models"]:
    if m.get("hub"):
        print("==>", m["name"], "resolves offline:", resolve_model(m["name"], pull=False))'

# --- 4. the models: PREFIX/models (readable by everyone), linked from the service's cache --------------
say "models in $prefix/models, linked from $cache_dir/models (the unit's EDGERUN_HOME)"
run mkdir -p -m 0755 "$prefix/models" "$cache_dir/models"
run chmod 0755 "$prefix" "$prefix/models"
for f in "$here"/models/*; do
    [ -f "$f" ] || continue
    name="$(basename "$f")"
    dest="$prefix/models/$name"
    if [ -f "$dest" ] && cmp -s "$f" "$dest"; then
        say "  $name: already installed"
    else
        run cp "$f" "$dest.part"
        run chmod 0644 "$dest.part"
        run mv -f "$dest.part" "$dest"
    fi
    run ln -sfn "$dest" "$cache_dir/models/$name"
done
if [ -d "$here/hub" ]; then   # hub models (hf:ORG/REPO...): their files and records, as the pulling machine's cache
    say "hub models in $prefix/hub, linked from $cache_dir/hub; their records in $cache_dir/hub"
    place=("$python" "$here/place_hub.py" "$here" "$prefix" "$cache_dir")
    if [ "$dry" = 1 ]; then place+=(--dry-run); fi
    "${place[@]}" || { cleanup_new; die "placing the hub models failed; the previous version is unchanged"; }
    # each resolves from the installed cache with no network, as the service will resolve it (an INT4
    # checkpoint finds the converted GGUF the bundle carries: nothing is converted on the board)
    run env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root EDGERUN_HOME="$cache_dir" HF_HUB_OFFLINE=1 \
        "$new/bin/python" -c "$resolve_check" "$here/manifest.json" ||
        { cleanup_new; die "a hub model does not resolve from $cache_dir; the previous version is unchanged"; }
fi

# --- 5. the switch: PREFIX/venv -> the new venv, one rename -------------------------------------------------
if [ -d "$prefix/venv" ] && [ ! -L "$prefix/venv" ]; then
    say "moving the venv of an earlier install ($prefix/venv) to $prefix/venvs/previous-$stamp"
    run mv "$prefix/venv" "$prefix/venvs/previous-$stamp"
fi
say "switching $prefix/venv -> $new"
run ln -sfn "$new" "$prefix/.venv.new"
run mv -T "$prefix/.venv.new" "$prefix/venv"
if [ "$dry" = 0 ]; then           # keep the newest $keep earlier venvs (roll back: point the link at one)
    { ls -1dt "$prefix"/venvs/* 2>/dev/null || true; } | { grep -vxF "$new" || true; } | tail -n +$((keep + 1)) |
        while IFS= read -r old; do say "removing an old venv: $old"; rm -rf "$old"; done
fi

# --- 6. the env file (kept if it exists) and the unit ---------------------------------------------------------
run mkdir -p "$etc_dir" "$unit_dir"
if [ -e "$etc_dir/edgerun.env" ]; then
    say "keeping the existing $etc_dir/edgerun.env (the bundle's is $here/deploy/edgerun.env)"
else
    write_file "$etc_dir/edgerun.env" 0644 <"$here/deploy/edgerun.env"
fi
if [ "$dry" = 1 ]; then
    say "the unit: \`$prefix/venv/bin/edgerun service print --env-file $etc_dir/edgerun.env --profile $profile\` > $unit_dir/edgerun.service"
else
    printf '%s\n' "$unit_text" | write_file "$unit_dir/edgerun.service" 0644
fi
case "$profile" in
    jetson-*)   # the unit names SupplementaryGroups=video render (the GPU's device nodes): systemd refuses a
                # unit whose group does not exist, so create a missing one (as deploy/install.sh does)
        for g in video render; do
            if ! getent group "$g" >/dev/null; then run groupadd --system "$g"; fi
        done ;;
esac
if [ "$cache_dir" != /var/cache/edgerun ]; then
    say "note: the unit's EDGERUN_HOME is /var/cache/edgerun; set EDGERUN_HOME=$cache_dir in $etc_dir/edgerun.env to use this one"
fi

# --- 7. systemd ----------------------------------------------------------------------------------------------
if [ "$offline" = 1 ] || [ ! -d /run/systemd/system ] || ! command -v systemctl >/dev/null 2>&1; then
    say "no running systemd here: the unit is written to $unit_dir/edgerun.service; nothing was started"
    say "by hand: EDGERUN_HOME=$cache_dir $prefix/venv/bin/edgerun generate -m $model --no-pull 'Hello'"
    exit 0
fi
run systemctl daemon-reload
run systemctl enable edgerun.service
if [ "$start" = 1 ]; then
    run systemctl restart edgerun.service
    say "started: systemctl status edgerun; journalctl -u edgerun -f"
else
    say "enabled, not started (--no-start): systemctl start edgerun"
fi
