"""A shim for tools that look for setup.py (older pip, `python setup.py develop`, some IDEs and packagers): the
project's metadata lives in pyproject.toml alone, which setuptools reads from here."""

from setuptools import setup

setup()
