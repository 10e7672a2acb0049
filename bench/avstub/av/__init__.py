"""Placeholder for PyAV on the benchmark machine (which has none and cannot install it): ComfyUI's
comfy_api imports PyAV's names at import time for video files; no benchmark path reads or writes video.
Every ``av.*`` module and name resolves to an inert placeholder class."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("PyAV is not installed on this benchmark machine")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Placeholder,), {})


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
