"""The Ray backend: ranks on the nodes of a Ray cluster (SPEC §11, docs/ray.md).

``cluster.py`` connects (``air_magic.ray_init``), ``placement.py`` reserves nodes and
puts an agent on each, ``agent.py`` runs on a node and starts its ranks,
``run_loop.py`` follows a call from the caller, ``backend.py`` is the seam.
"""
