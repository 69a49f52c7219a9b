"""An offline bundle: everything a board with no network needs to install and run edgerun, in one folder.

``make_bundle`` runs on a connected Linux machine and writes, for one device profile and one Python
version::

    DIR/install.sh          the offline installer (deploy/bundle-install.sh): checks, verifies, installs
    DIR/manifest.json       target (Python, machine, glibc), models, and every file's size and sha256
    DIR/wheels/*.whl        edgerun, llama-cpp-python (built with the profile's CMAKE_ARGS + RPC), and every
                            dependency (pip download --platform/--python-version --only-binary)
    DIR/models/*.gguf       the models, copied from the verified cache (variants included)
    DIR/hub/ORG/REPO/...    hub models (hf:ORG/REPO...): the pulled revision's verified files and the name's
                            record, as the cache holds them (models/converted/: a checkpoint's GGUF)
    DIR/place_hub.py        lays the hub models out in the board's cache (deploy/bundle-place-hub.py)
    DIR/deploy/             the systemd unit and the env file (model, drafter, profile, no pulls)

The folder is built beside DIR under a hidden temporary name and renamed at the end (util.atomic), so a
killed bundle never leaves a folder that looks complete; a tarball is written the same way. A rerun into
an existing bundle reuses its wheels whose sha256 still matches its manifest (pip sees them as already
downloaded), and llama-cpp-python built here is kept in the cache ($EDGERUN_HOME/wheels) for the next run.

By subject: spec.py (what is asked, the board it describes), wheels.py (edgerun's wheel, llama-cpp-python
for the board, the dependencies), files.py (hashing, placing, reusing verified files), make.py (writing the
folder or tarball and its manifest), models.py (the registry's and the hub's models, verified then carried).
"""

from __future__ import annotations

from .files import sha256_file
from .make import FORMAT, env_file_text, make_bundle, resolve_models
from .spec import DEFAULT_GLIBC, BundleError, BundleResult, BundleSpec, Target, target_for
from .wheels import build_edgerun_wheel, check_llama_wheel, download_dependencies, llama_pin, llama_wheel_for, source_root

__all__ = ["DEFAULT_GLIBC", "FORMAT", "BundleError", "BundleResult", "BundleSpec", "Target", "build_edgerun_wheel",
           "check_llama_wheel", "download_dependencies", "env_file_text", "llama_pin", "llama_wheel_for",
           "make_bundle", "resolve_models", "sha256_file", "source_root", "target_for"]
