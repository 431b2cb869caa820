"""record(): the small immutable records of the warm path, as tuples with named fields.

``collections.namedtuple`` builds each class through ``exec`` of generated source, about 0.12 ms per
class on the 2-core dev box; five such classes took half a millisecond of every warm load (under 5 ms in
all). A record is built from plain functions instead (about 0.02 ms) and behaves as those records were
used: a tuple (immutable, hashable, equal and ordered by its fields, unpackable, picklable) whose fields
are also attributes, with positional or keyword arguments and trailing defaults.
"""

from __future__ import annotations

import sys
from operator import itemgetter


def record(typename: str, fields: list[str], defaults: tuple = ()) -> type:
    """A tuple subclass named ``typename`` with ``fields``; the last ``len(defaults)`` fields are optional."""
    fields = tuple(fields)
    count, optional = len(fields), dict(zip(fields[len(fields) - len(defaults):], defaults))

    def __new__(cls, *args, **kwargs):
        if kwargs or len(args) != count:
            if len(args) > count:
                raise TypeError(f"{typename}() takes {count} arguments, got {len(args)}")
            given = dict(zip(fields, args))
            for name, value in kwargs.items():
                if name not in fields or name in given:
                    raise TypeError(f"{typename}() got an unexpected or repeated argument {name!r}")
                given[name] = value
            missing = [f for f in fields if f not in given and f not in optional]
            if missing:
                raise TypeError(f"{typename}() is missing {', '.join(missing)}")
            args = tuple(given[f] if f in given else optional[f] for f in fields)
        return tuple.__new__(cls, args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={v!r}' for f, v in zip(fields, self))})"

    def __getnewargs__(self) -> tuple:
        return tuple(self)

    # The caller's module, as namedtuple sets it, so pickle finds a record assigned to a module-level name.
    namespace = {"__module__": sys._getframe(1).f_globals.get("__name__", __name__), "__slots__": (), "_fields": fields, "__new__": __new__, "__repr__": __repr__,
                 "__getnewargs__": __getnewargs__}
    for index, name in enumerate(fields):
        namespace[name] = property(itemgetter(index))
    return type(typename, (tuple,), namespace)
