"""What to run and where: settings, accelerators, the payload, each rank's environment, failures.

Knows no backend: every backend starts ranks from what this layer describes.
"""
