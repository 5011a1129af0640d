"""The call layer: the one place that picks a backend and wires consumers for a call.

Where a call runs: in the foreground (``call.py``), a background thread (``background.py``), under
a detached supervisor (``detached.py``, ``supervisor.py``) or as a persistent session's cells
(``persistent.py``, ``cell_loop.py``; ``air_magic.session(...)`` is ``persistent.session``).
"""
