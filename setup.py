"""Maps the top-level folders router/ and node/ to the packages gpumesh.router and gpumesh.node
(everything else about the distribution is in pyproject.toml)."""

from setuptools import find_packages, setup

PACKAGE_DIRS = {"gpumesh": "gpumesh", "gpumesh.router": "router", "gpumesh.node": "node"}


def _packages() -> list[str]:
    out: list[str] = []
    for name, folder in PACKAGE_DIRS.items():
        out.append(name)
        out.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return out


setup(packages=_packages(), package_dir=PACKAGE_DIRS)
