"""Named registries of extension points (advantage estimators, policy losses,
reward functions) that also accept a dotted path to a user function."""
from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


def load_dotted(path: str) -> Callable:
    """Import `pkg.module:attr` (attr may be `Class.method`) or `pkg.module.attr`."""
    if ":" in path:
        module_name, attr_path = path.split(":", 1)
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"bad dotted path {path!r}: expected 'pkg.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} of {path!r}: {e}") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{path!r}: {type(obj).__name__} {obj!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    return obj


class Registry(Generic[F]):
    """Maps names to functions of one kind; `get` also takes dotted paths.

    kind: what is registered, for error messages ("advantage estimator").
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: `@registry.register("name")`; a name is taken once."""

        def deco(fn: F) -> F:
            if name in self._fns and self._fns[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            return fn

        return deco

    def names(self) -> list[str]:
        return sorted(self._fns)

    def get(self, name_or_path: str) -> F:
        """A registered name, or a dotted path 'pkg.module:function'."""
        if name_or_path in self._fns:
            return self._fns[name_or_path]
        if ":" in name_or_path or "." in name_or_path:
            return load_dotted(name_or_path)  # type: ignore[return-value]
        raise ValueError(
            f"unknown {self.kind} {name_or_path!r}; available: {', '.join(self.names())} "
            f"(or a dotted path 'pkg.module:function')"
        )
