"""Package discovery, the one thing pyproject.toml cannot say: every package under hpc/ and trainer/
(found, so a new subpackage needs no line here), plus hpc._sites, the bundled site profiles, which
pyproject.toml maps onto the top-level site/ folder ([tool.setuptools.packages.find] finds only
packages that lie in their parent's folder). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["hpc", "hpc.*", "trainer", "trainer.*"]), "hpc._sites"])
