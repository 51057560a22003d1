"""How upstream names are reached and patched: `resolve` finds the object a dotted name names,
`borrow` the same or None, noting the name `missing` (compat/upstream.py raises for them all);
a `Patcher` replaces only the attributes its table lists (compat/upstream.py's PATCHES) and puts
back what it replaced, newest first. Nothing here names upstream code."""

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

_ABSENT = object()


def resolve(dotted: str) -> Any:
    """The object a dotted name names: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is None or not f"{module}.".startswith(f"{error.name}."):
                raise  # the module exists, but something it imports does not
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise AttributeError(dotted)


class Patcher:
    """Patches the attributes `listed` names ({dotted target: why}), refusing any other, and
    undoes them (`undo`): what each applied patch replaced, in order."""

    def __init__(self, listed: dict[str, str], table_name: str,
                 torch_function_mode_target: str) -> None:
        self._listed, self._table_name = listed, table_name
        self._mode_target = torch_function_mode_target
        self._applied: dict[str, Callable[[], None]] = {}

    def _owner_and_name(self, target: str) -> tuple[Any, str]:
        if target not in self._listed:
            raise KeyError(f"{target} is not listed in {self._table_name}")
        owner, _, name = target.rpartition(".")
        return resolve(owner), name

    def _replace(self, target: str, replacement: Any) -> Callable[[], None]:
        """Set the attribute; return what puts back the original (removing an attribute the
        owner only inherited)."""
        owner, name = self._owner_and_name(target)
        original = vars(owner).get(name, _ABSENT)
        setattr(owner, name, replacement)
        return lambda: setattr(owner, name, original) if original is not _ABSENT \
            else delattr(owner, name)

    def current(self, target: str) -> Any:
        """A listed attribute as it is now (the original, before it is patched)."""
        owner, name = self._owner_and_name(target)
        return getattr(owner, name)

    def patch(self, target: str, replacement: Any) -> None:
        """Replace a listed attribute until undo(); patching it again keeps the first
        original."""
        undo = self._replace(target, replacement)
        self._applied.setdefault(target, undo)

    def is_patched(self, target: str) -> bool:
        return target in self._applied

    @contextlib.contextmanager
    def temporarily(self, target: str, replacement: Any) -> Iterator[None]:
        """Replace a listed attribute for the duration of a block."""
        undo = self._replace(target, replacement)
        try:
            yield
        finally:
            undo()

    def enter_torch_function_mode(self, mode: Any) -> None:
        """Enter a torch function mode for the rest of the process, until undo()."""
        if self.is_patched(self._mode_target):
            raise RuntimeError("a torch function mode is already entered by megatron_muon")
        mode.__enter__()
        self._applied[self._mode_target] = lambda: mode.__exit__(None, None, None)

    def undo(self) -> None:
        """Put back everything patch() and enter_torch_function_mode() changed, newest first."""
        for undo in reversed(list(self._applied.values())):
            undo()
        self._applied.clear()


# Borrowed names the installed versions lack: dotted name -> why megatron-muon needs it
# (compat/upstream.py raises one ImportError naming them all).
missing: dict[str, str] = {}


def borrow(dotted: str, why: str, get: Callable[[], Any] | None = None) -> Any:
    """The named object (`get` finds one that no dotted name reaches), or None, recorded as
    missing, when the installed version lacks it."""
    try:
        return get() if get else resolve(dotted)
    except AttributeError:
        pass
    except RuntimeError:  # torch.ops raises it for an unknown op; elsewhere it is not ours to hide
        if not dotted.startswith("torch.ops."):
            raise
    missing[dotted] = why
    return None


def borrow_first(locations: tuple[str, ...], why: str) -> Any:
    """The object at the first of `locations` the installed version has (a name upstream moved:
    its new location first, the old as fallback), or None, recorded as missing, where neither."""
    for dotted in locations:
        found = borrow(dotted, why)
        if found is not None:
            for missed in locations:
                missing.pop(missed, None)
            return found
    return None
