"""Fields that were renamed: a dataclass's constructor still takes their former keywords.

``RunInfo(run_id=...)`` and ``RunResult(run_id=...)`` from before the call id was
named ``call_id`` (issue 49) still build the same object; the former name is read
back through the class's own property (which type checkers see). Both names, with
different values, are an error, as in ``make_settings`` (launch/settings.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def former_names(**renamed: str) -> Callable[[T], T]:
    """``@former_names(run_id="call_id")`` above ``@dataclass``: ``run_id=`` is taken for ``call_id=``."""

    def wrap(cls: T) -> T:
        generated = cls.__init__  # type: ignore[misc]

        @functools.wraps(generated)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for old, new in renamed.items():
                if old not in kwargs:
                    continue
                value = kwargs.pop(old)
                if new in kwargs and kwargs[new] != value:
                    raise TypeError(
                        f"{cls.__name__}() got both {old}={value!r} and {new}={kwargs[new]!r}; "
                        f"{old} is the former name of {new}"
                    )
                kwargs[new] = value
            generated(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return wrap
