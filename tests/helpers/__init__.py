"""What the tests share, one copy each (imported as ``helpers.X``; pyproject puts tests/ on sys.path).

- ``paths``: the repository's folders (examples, package, docs, the caller scripts here).
- ``procs``: waiting for processes to end; the leftover check of every test.
- ``ranks``: one call on real ranks, the warm starter's readiness, the MLflow status of a call.
- ``recording``: a consumer that keeps a call's events, and a backend wrapped to feed it.
- ``cli``: ``air-magic`` run as a shell runs it.
- ``kernel``: Jupyter kernels and IPython shells.

The other files here (``*_caller.py``) are scripts the tests run as separate callers.
"""
