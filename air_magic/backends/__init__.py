"""How ranks are started, watched and stopped.

``base.Backend`` is the seam every backend implements; ``local`` is the first backend.
"""
