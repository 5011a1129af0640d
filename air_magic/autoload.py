"""Opt in once to loading air_magic in every kernel: ``python -m air_magic.autoload enable``.

Copies the startup file shipped in ``jupyter-config/`` into
``<IPYTHONDIR>/profile_<name>/startup/50-air_magic.py``. It writes only that
file of its own and never edits a user's configuration; a different file
already at that path is left alone (and reported). ``disable`` removes the
file only when it is ours; ``status`` says where things stand.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

STARTUP_NAME = "50-air_magic.py"


def shipped_startup() -> str:
    return resources.files("air_magic.jupyter_config").joinpath("air_magic_startup.py").read_text()


def startup_path(profile: str = "default") -> Path:
    from IPython.paths import get_ipython_dir

    return Path(get_ipython_dir()) / f"profile_{profile}" / "startup" / STARTUP_NAME


def enable(profile: str = "default") -> str:
    path = startup_path(profile)
    ours = shipped_startup()
    if path.exists() and path.read_text() != ours:
        return f"not changed: {path} exists and is not air_magic's; remove or rename it first"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ours)
    return f"enabled: every IPython kernel of profile {profile!r} loads air_magic ({path})"


def disable(profile: str = "default") -> str:
    path = startup_path(profile)
    if not path.exists():
        return f"already disabled ({path} does not exist)"
    if path.read_text() != shipped_startup():
        return f"not changed: {path} is not air_magic's file"
    path.unlink()
    return f"disabled: removed {path}"


def status(profile: str = "default") -> str:
    path = startup_path(profile)
    if not path.exists():
        return f"disabled ({path} does not exist)"
    if path.read_text() == shipped_startup():
        return f"enabled ({path})"
    return f"{path} exists but is not air_magic's file"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m air_magic.autoload", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["enable", "disable", "status"])
    parser.add_argument("--profile", default="default", help="IPython profile (default: default)")
    args = parser.parse_args(argv)
    message = {"enable": enable, "disable": disable, "status": status}[args.command](args.profile)
    print(message)
    return 1 if message.startswith("not changed") else 0


if __name__ == "__main__":
    sys.exit(main())
