"""Keyword arguments from a config against the annotations of the callable they go to.

Hydra passes what the command line says: ``dataset.per_category=abc`` reached ``load_spec_bench`` as a str and
failed deep inside with ``'>=' not supported between 'int' and 'str'``; ``logger.tags=5`` as an int. Here each
annotated argument is converted by msgspec (strictly: ``'5'`` is not an int, ``1.5`` is not an int), so a bad
value is refused before anything runs, naming the config key, the value and the type it must have. Arguments
without an annotation, or whose annotation msgspec cannot check, pass unchecked.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

__all__ = ["check_arg_types"]


def check_arg_types(fn: Callable, kwargs: Mapping[str, Any], where: str) -> None:
    """TypeError naming ``<where>.<key>`` for the first of ``kwargs`` whose value does not fit ``fn``'s annotation."""
    try:
        hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: nothing to check against
        return
    for key, value in kwargs.items():
        hint = hints.get(key)
        if hint is None or hint is Any:
            continue
        try:
            msgspec.convert(value, hint)
        except msgspec.ValidationError as e:
            raise TypeError(f"{where}.{key}={value!r} is invalid: {str(e).partition(' - at ')[0]} "
                            f"(the parameter is {_name(hint)})") from None
        except (TypeError, ValueError):  # a type msgspec does not know (a class, a callable): not checked here
            continue


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
