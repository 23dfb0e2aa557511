"""The client hands its callers its own result types, never protobuf messages: callers
depend on the client's API, not on the wire format behind it."""

from __future__ import annotations

import inspect
import typing

import pytest

from kvstore.client import KVClient


def _wire_types(annotation) -> list:
    """Every class named by a return annotation (through Optional, unions, lists) that
    comes from the generated protobuf modules."""
    found, todo = [], [annotation]
    while todo:
        t = todo.pop()
        todo.extend(typing.get_args(t))
        if isinstance(t, type) and t.__module__.startswith("kvstore.v1"):
            found.append(t)
    return found


@pytest.mark.parametrize("cls", [KVClient])
def test_public_methods_return_no_protobuf_messages(cls):
    offenders = {}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_"):
            continue
        hints = typing.get_type_hints(fn)
        wire = _wire_types(hints.get("return"))
        if wire:
            offenders[name] = [t.__name__ for t in wire]
    assert not offenders, f"methods returning protobuf messages: {offenders}"
