"""``python -m air_magic run ...``: the command line (cli.py)."""

from air_magic.cli import main

raise SystemExit(main())
