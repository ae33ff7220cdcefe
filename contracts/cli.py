"""Flags shared by the management commands: comma-separated lists, parsed once.

``list_option(options, "gpus", int, minimum=1)`` reads a list flag in ``handle`` and raises a
``CommandError`` naming the flag (``--gpus: 65 is above the maximum 64``). It parses in ``handle``
rather than as an argparse ``type=`` because ``call_command(name, gpus="4,8")`` hands keyword options
to ``handle`` as given, past the parser's types.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from django.core.management.base import CommandError


class ListError(ValueError):
    """A list flag's value is not one this flag accepts (the message says why)."""


def comma_list(
    item: Callable[[str], Any] = str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: Collection[str] | None = None,
    empty_ok: bool = False,
) -> Callable[[str], tuple]:
    """A parser that turns ``"1,2,4"`` into ``(1, 2, 4)``: each item through ``item``, blanks
    skipped, each number within ``minimum``/``maximum``, each name one of ``choices``."""

    def parse(text: str) -> tuple:
        values = []
        for raw in (part.strip() for part in text.split(",")):
            if not raw:
                continue
            try:
                value = item(raw)
            except ValueError as exc:
                raise ListError(f"{raw!r}: {exc}") from None
            if choices is not None and value not in choices:
                raise ListError(f"unknown {raw!r}; choose from {','.join(choices)}")
            if minimum is not None and value < minimum:
                raise ListError(f"{raw} is below the minimum {minimum}")
            if maximum is not None and value > maximum:
                raise ListError(f"{raw} is above the maximum {maximum}")
            values.append(value)
        if not values and not empty_ok:
            raise ListError("give at least one value")
        return tuple(values)

    return parse


def list_option(options: dict[str, Any], name: str, item: Callable[[str], Any] = str, **rules: Any) -> tuple:
    """The list flag ``--<name>`` of a command's ``options``, parsed by :func:`comma_list` ``rules``;
    ``None`` stays ``None`` (a flag whose absence means "the default set")."""
    text = options[name]
    if text is None:
        return None
    if isinstance(text, (tuple, list)):
        text = ",".join(str(value) for value in text)
    try:
        return comma_list(item, **rules)(str(text))
    except ListError as exc:
        raise CommandError(f"--{name.replace('_', '-')}: {exc}") from None
