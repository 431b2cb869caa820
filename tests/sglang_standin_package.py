"""Template of a stand-in package (tests/release_kit.py copies it in as ``<name>/__init__.py``).

Every name in the package, and in any of its submodules that has no file of
its own, imports fine and raises when called: SGLang imports many names of
sgl-kernel (and, on CUDA, flashinfer) at import time, and its host pools must
reach none of them once this package's plugin is active.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types


class UnavailableOp:
    """A callable (and attribute bag) that raises when called."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{__name__} stand-in: {self._name} was called; the plugin must route every HiCache "
                           "transfer away from it")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return UnavailableOp(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):  # used as a base class somewhere: give a plain class
        return (object,)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return UnavailableOp(f"{__name__}.{name}")


class _AnySubmodule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any <package>.x.y without a file of its own imports as a module whose names raise when called."""

    def __init__(self, package: str, directory: str):
        self.package, self.directory = package, directory

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(self.package + "."):
            return None
        relative = fullname[len(self.package) + 1:].replace(".", os.sep)
        if os.path.exists(os.path.join(self.directory, relative + ".py")):
            return None  # a generated submodule (sgl_kernel.kvcacheio): the normal finders load it
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr, _n=spec.name: (_ for _ in ()).throw(AttributeError(attr)) \
            if attr.startswith("__") else UnavailableOp(f"{_n}.{attr}")
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_AnySubmodule(__name__, os.path.dirname(__file__)))
__version__ = "0.0.0"  # release_kit writes the version the release pins
