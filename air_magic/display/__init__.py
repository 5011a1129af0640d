"""Consumers that show a call: tabs (ipywidgets), rank-prefixed text. They never drive processes."""
