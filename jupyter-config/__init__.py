"""Configuration files air_magic ships for Jupyter and IPython (installed as package data).

This folder is installed as the package ``air_magic.jupyter_config`` (see
``pyproject.toml``). ``python -m air_magic.autoload enable`` copies
``air_magic_startup.py`` into the IPython profile's ``startup/`` folder, so
every kernel (and IPython terminal) of that profile loads the extension.
"""
