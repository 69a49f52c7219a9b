"""Build hook: the design card's top-level data folders travel inside the wheel as edgerun/_data/.

An editable install needs no copy: edgerun.util.resources finds the folders in the checkout."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

DATA_FOLDERS = ("models", "device_profiles", "kernels")


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder in DATA_FOLDERS:
            self.copy_tree(folder, os.path.join(self.build_lib, "edgerun", "_data", folder))


setup(cmdclass={"build_py": BuildPyWithData})
