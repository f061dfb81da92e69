"""`LLM`'s and `AsyncLLM`'s RL methods, made from the verbs' declarations (shoal/rl_verbs.py):
one per public verb and per alias, with the verb's signature and docstring (`help(LLM.sleep)`).

A method binds its arguments as the signature says, then runs the verb's plan: the engine-core
utility calls that make up the verb, each call's result sent back in. Most verbs are one call of
their own name; a verb's `frontend` plan may make several (`update_weights_from_tensors`: a
check, then one call per bucket). `LLM` runs the plan's calls one after the other, `AsyncLLM`
awaits each.

The arguments cross to the engine core as msgspec data: each is made its declared type first,
so that a `Path` for a `str`, a `torch.dtype` for a dtype name or a `torch.Size` for a shape
travel as the engine expects.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Generator
from typing import Any

from shoal import rl_verbs
from shoal.rl_verbs import Verb

UtilityCall = tuple[str, tuple[Any, ...]]
Plan = Generator[UtilityCall, Any, Any]
MethodMaker = Callable[[Verb, type, str], Callable[..., Any]]


def install_verb_methods(cls: type, make_method: MethodMaker) -> None:
    """Give `cls` the method of every public verb and alias, now and as verbs are declared."""

    def on_change(verb: Verb, declared: bool) -> None:
        if not verb.public:
            return
        for name in (verb.name, *verb.aliases):
            if not declared:
                delattr(cls, name)
            elif name in vars(cls):
                raise TypeError(f"{cls.__name__}.{name} is written by hand and declared as an RL verb: keep one")
            else:
                setattr(cls, name, make_method(verb, cls, name))

    rl_verbs.subscribe(on_change)


def sync_method(verb: Verb, owner: type, name: str) -> Callable[..., Any]:
    """A method that runs the verb's calls through `self._call(method, *args)`."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls = plan(verb, args, kwargs)
        try:
            call = next(calls)
            while True:
                call = calls.send(self._call(call[0], *call[1]))
        except StopIteration as done:
            return done.value
        finally:
            calls.close()  # a call that raised: the plan's buffers are released now

    return _dressed(method, verb, owner, name)


def async_method(verb: Verb, owner: type, name: str) -> Callable[..., Any]:
    """A coroutine method that awaits each of the verb's calls, `await self._call(method, *args)`."""

    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls = plan(verb, args, kwargs)
        try:
            call = next(calls)
            while True:
                call = calls.send(await self._call(call[0], *call[1]))
        except StopIteration as done:
            return done.value
        finally:
            calls.close()

    return _dressed(method, verb, owner, name)


def plan(verb: Verb, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    """The engine-core calls of one call of `verb` (a TypeError for arguments that do not fit
    its signature, as any function's)."""
    bound = verb.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    if verb.frontend is not None:
        module, _, function = verb.frontend.partition(":")
        return getattr(importlib.import_module(module), function)(*bound.args, **bound.kwargs)
    parameters = verb.signature.parameters
    return _one_call(verb.name, tuple(_as_declared(parameters[n].annotation, v) for n, v in bound.arguments.items()))


def _one_call(method: str, args: tuple[Any, ...]) -> Plan:
    return (yield method, args)


def _as_declared(annotation: Any, value: Any) -> Any:
    if value is None:
        return None
    if annotation in (str, str | None):
        return str(value)
    if annotation in (list[str], list[str] | None):
        return [str(item) for item in value]
    if annotation == list[list[int]]:
        return [list(shape) for shape in value]
    return value


def _dressed(method: Callable[..., Any], verb: Verb, owner: type, name: str) -> Callable[..., Any]:
    """`method` named, documented and signed as the verb (`help`, `inspect.signature`)."""
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = verb.signature.replace(  # type: ignore[attr-defined]
        parameters=[self_parameter, *verb.signature.parameters.values()]
    )
    method.__name__ = name
    method.__qualname__ = f"{owner.__name__}.{name}"
    method.__module__ = owner.__module__
    method.__doc__ = verb.doc if name == verb.name else f"{verb.doc}\n\n(`{name}` is another name of `{verb.name}`.)"
    return method
