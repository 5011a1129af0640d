"""Widget models every view of a kernel shares: one layout and one style, made once.

Each widget model is a message to the browser and about 1 ms of the kernel's
time; a view made for every cell of a persistent session pays that each time,
so the views share these instead of making their own.
"""

from __future__ import annotations

from typing import Any

_SHARED: dict[str, Any] = {}


def shared(kind: str) -> Any:
    """One layout (or style) model for every view of this kernel: 'layout', 'wide', 'output' or 'style'.

    Made again if closed (``Widget.close_all()``)."""
    import ipywidgets as w

    found = _SHARED.get(kind)
    if found is None or getattr(found, "comm", None) is None:
        if kind == "output":
            found = w.Layout(max_height="30em", overflow="auto")
        elif kind == "wide":
            found = w.Layout(width="100%")
        elif kind == "style":
            try:  # ipywidgets 8; 7 styles an HTML widget with a DescriptionStyle
                from ipywidgets.widgets.widget_string import HTMLStyle as style_class
            except ImportError:
                style_class = w.DescriptionStyle
            found = style_class()
        else:
            found = w.Layout()
        _SHARED[kind] = found
    return found


def html_kwargs() -> dict[str, Any]:
    """What an HTML widget of a view is made with: the shared layout and style."""
    return {"layout": shared("layout"), "style": shared("style")}
