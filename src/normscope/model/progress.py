"""Progress of a long model-level job: a callable that takes a message (``say``), shown on a terminal's stderr."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Progress = Callable[[str], None]


@contextlib.contextmanager
def progress(progress: bool | Progress) -> Iterator[Progress]:
    if callable(progress):
        yield progress
        return
    if not progress:
        yield lambda _msg: None
        return
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda _msg: None
        return
    with console.status("working…") as status:
        yield lambda msg: status.update(msg)
