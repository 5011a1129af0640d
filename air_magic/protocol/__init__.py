"""What the caller, its backends and the ranks agree on: files, pickles, events, variable names.

Imports only the standard library, cloudpickle and the base modules (errors, paths).
"""
