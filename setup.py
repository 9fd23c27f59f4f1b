"""Build hook: the wheel carries conf/ as torchbeast_hydra/conf, where an installed command finds it.

conf/ stays at the top of the repo (the layout); a checkout or an editable install reads it there
(see torchbeast_hydra.__main__.config_dir). Everything else is declared in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONF = Path(__file__).resolve().parent / "conf"


class BuildPyWithConf(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # the source tree's conf/ is used in place
            return
        target = Path(self.build_lib) / "torchbeast_hydra" / "conf"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(CONF, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithConf})
