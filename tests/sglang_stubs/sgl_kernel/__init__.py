"""Stand-in for an sgl_kernel whose ops are unusable: every name raises when called."""

import importlib.abc
import importlib.machinery
import sys
import types


class UnavailableOp:
    """A callable (and attribute bag) that raises when called."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"sgl_kernel stand-in: {self._name} was called; the plugin must route every HiCache "
                           "transfer away from sgl-kernel")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return UnavailableOp(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):  # used as a base class somewhere: give a plain class
        return (object,)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return UnavailableOp(f"sgl_kernel.{name}")


class _AnySubmodule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any sgl_kernel.x.y imports as a module whose names raise when called."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel.") and fullname != "sgl_kernel.kvcacheio":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr, _n=spec.name: (_ for _ in ()).throw(AttributeError(attr)) \
            if attr.startswith("__") else UnavailableOp(f"{_n}.{attr}")
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_AnySubmodule())
__version__ = "0.0.0-standin"
