"""buildcache.record: the warm path's records behave as the tuples they replace (namedtuple's contract as used)."""

import pickle

import pytest

from sglang_hicache_jit.buildcache.arch import Arch
from sglang_hicache_jit.buildcache.record import record

Point = record("Point", ["x", "y", "z"], defaults=(0,))


def test_fields_positions_keywords_and_defaults():
    p = Point(1, 2)
    assert (p.x, p.y, p.z) == (1, 2, 0) and tuple(p) == (1, 2, 0)
    assert Point(1, z=3, y=2) == Point(1, 2, 3) == (1, 2, 3)
    assert repr(Point(1, 2)) == "Point(x=1, y=2, z=0)" and Point._fields == ("x", "y", "z")


@pytest.mark.parametrize("args, kwargs", [((1, 2, 3, 4), {}), ((1,), {}), ((1, 2), {"x": 5}), ((1, 2), {"w": 1})])
def test_wrong_arguments_raise_type_error(args, kwargs):
    with pytest.raises(TypeError, match="Point"):
        Point(*args, **kwargs)


def test_immutable_hashable_ordered_and_picklable():
    p = Point(1, 2)
    with pytest.raises(AttributeError):
        p.x = 5
    assert {p: 1}[Point(1, 2, 0)] == 1
    assert sorted([Point(2, 0), Point(1, 9)]) == [Point(1, 9), Point(2, 0)]
    assert pickle.loads(pickle.dumps(p)) == p


def test_subclasses_keep_their_methods_and_slots():
    arch = Arch(9, 0, "a")
    assert arch.tag == "sm90a" and arch.ptx is False and str(arch) == "9.0a"
    assert not hasattr(arch, "__dict__")
    assert pickle.loads(pickle.dumps(arch)) == arch and type(pickle.loads(pickle.dumps(arch))) is Arch
