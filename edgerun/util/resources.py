"""Where edgerun's data folders are: models/, device_profiles/ and kernels/ (the design card's top level).

A wheel carries them as edgerun/_data/<folder> (setup.py copies them at build time); a source checkout
or an editable install (`pip install -e .`) reads them straight from the repository's top level.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import EdgerunError

FOLDERS = ("models", "device_profiles", "kernels")
_PACKAGE = Path(__file__).resolve().parent.parent          # .../edgerun


def data_dir(folder: str) -> Path:
    """The folder of shipped `folder` files ('models', 'device_profiles' or 'kernels')."""
    if folder not in FOLDERS:
        raise ValueError(f"unknown data folder {folder!r}; expected one of {', '.join(FOLDERS)}")
    packaged = _PACKAGE / "_data" / folder
    if packaged.is_dir():
        return packaged
    checkout = _PACKAGE.parent
    if (checkout / folder).is_dir() and (checkout / "pyproject.toml").is_file():
        return checkout / folder
    raise EdgerunError(f"edgerun's {folder}/ folder is missing (looked in {packaged} and {checkout / folder}); "
                       "the installation is incomplete: reinstall edgerun")
