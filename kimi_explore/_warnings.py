"""Warnings that point at the user's line: the first frame outside this package (how deep the package's own frames
go differs by route, the token path, the sequence path or a pipeline, so no fixed stacklevel names that line)."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the function calling this one
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
