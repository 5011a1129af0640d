"""What the caller, its backends and the ranks agree on: files, pickles, events, variable names.

Imports nothing of air_magic's: only the standard library and cloudpickle.
"""
