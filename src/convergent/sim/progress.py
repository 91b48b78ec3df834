"""The campaign's rich progress bar: frames done / total, rate, elapsed, ETA, status."""

from __future__ import annotations


def make_progress(enabled: bool, console=None):
    """A ``rich.progress.Progress`` (disabled, i.e. silent, unless ``enabled``)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:  # type: ignore[override]
            speed = task.finished_speed or task.speed
            return Text("--/s" if speed is None else f"{speed:.1f}/s")

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        disable=not enabled,
        refresh_per_second=4,  # the driver's core is shared with a worker
        console=console,
        transient=False,
    )

