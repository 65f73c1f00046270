"""Build hook (the project's metadata is in pyproject.toml).

The split-certified roster is written by ``scripts/certify.py`` to ``roster/split-certified.json``
at the repository root, where CI's ``certify.py --check`` keeps it in step with ``patches/``. An
installed wheel has no repository root, so the build copies the roster into the package as
``skippy_llama/_data/split-certified.json``, where :mod:`skippy_llama.roster` finds it when no
checkout's roster is beside the package.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROSTER = Path(__file__).resolve().parent / "roster" / "split-certified.json"


class BuildPyWithRoster(build_py):
    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "skippy_llama" / "_data" / "split-certified.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROSTER, dest)


setup(cmdclass={"build_py": BuildPyWithRoster})
