"""The call layer: the one place that picks a backend and wires consumers for a call."""
