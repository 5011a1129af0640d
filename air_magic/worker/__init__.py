"""Runs inside a rank: load a payload from a transport, call it, report; end like Python.

Imports protocol and errors only: nothing from the caller's side.
"""
