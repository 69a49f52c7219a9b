#!/usr/bin/env bash
# Open WebUI against edgerun, end to end (docs/clients.md, "Open WebUI"). A fixture script with its own
# requirements (bench/openwebui/requirements.txt): never run by CI or the tests.
#
#   bash bench/openwebui/run.sh [--work DIR] [--python PY] [--edgerun-python PY] [--install-only]
#                               [-- drive.py options: --builtin-tools, --ctx N, --threads N, --timeout S]
#
# --work DIR (default /tmp/edgerun-openwebui): Open WebUI's venv (DIR/venv, created once, several GB),
#   its data, the logs and result.json; nothing of it goes into the repository.
# --python PY: the Python 3.11 or 3.12 that makes the venv (default python3).
# --edgerun-python PY: a Python that imports edgerun and llama_cpp (default: the repo's .venv, else python3).
# TORCH_INDEX (environment): where the CPU-only torch comes from (default PyTorch's CPU index; empty:
#   pip's own configuration, e.g. a local wheel in PIP_FIND_LINKS). TORCH_VERSION pins it (default 2.13.0).
# Writes docs/openwebui-ollama.png and docs/openwebui-openai.png, WORK/result.json, bench/results/openwebui.json.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK=/tmp/edgerun-openwebui
PY=python3
EPY=""
INSTALL_ONLY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --work) WORK="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --edgerun-python) EPY="$2"; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --) shift; break ;;
    *) echo "error: unknown option $1" >&2; exit 2 ;;
  esac
done
if [[ -z "$EPY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then EPY="$ROOT/.venv/bin/python"; else EPY=python3; fi
fi
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
VENV="$WORK/venv"
STAMP="$VENV/.installed-$(sha256sum "$HERE/requirements.txt" | cut -c1-12)"

if [[ ! -f "$STAMP" ]]; then
  t0=$(date +%s)
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
  # torch first, CPU-only: open-webui's sentence-transformers would otherwise pull the CUDA build (GBs)
  nice -n 19 "$VENV/bin/pip" install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
    "torch==${TORCH_VERSION:-2.13.0}+cpu"
  nice -n 19 "$VENV/bin/pip" install -r "$HERE/requirements.txt"
  t1=$(date +%s)
  echo "installed open-webui $("$VENV/bin/python" -c 'import importlib.metadata as m;print(m.version("open-webui"))')" \
       "in $((t1 - t0)) s; venv $(du -sh "$VENV" | cut -f1)" | tee "$WORK/install.txt"
  touch "$STAMP"
fi

[[ $INSTALL_ONLY == 1 ]] && exit 0
exec "$VENV/bin/python" "$HERE/drive.py" --work "$WORK" --edgerun-python "$EPY" "$@"
