"""Placeholder for PyAV on the benchmark machine (which has none and cannot install it): ComfyUI's
comfy_api imports PyAV's names at import time for video files; no benchmark path reads or writes video.
Every ``av.*`` module and name resolves to an inert placeholder class."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Names(type):
    """Attributes of a placeholder class are placeholder classes too (``ColorTrc.SMPTE2084`` in ComfyUI 0.33.0's
    tables), the same object each time, so they can serve as dictionary keys."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        made = cls.__dict__.get("_made")
        if made is None:
            made = {}
            type.__setattr__(cls, "_made", made)
        if name not in made:
            made[name] = _Names(name, (_Placeholder,), {})
        return made[name]


class _Placeholder(metaclass=_Names):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("PyAV is not installed on this benchmark machine")


_MODULE_NAMES: dict = {}


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in _MODULE_NAMES:
        _MODULE_NAMES[name] = _Names(name, (_Placeholder,), {})
    return _MODULE_NAMES[name]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("av."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__getattr__ = __getattr__
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
