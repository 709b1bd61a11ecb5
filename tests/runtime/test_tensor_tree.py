"""tensors_in finds what pytree finds: the same tensors, in the same order, through every container an op takes or
returns (the profiler's dispatch modes rely on it for every op)."""
from __future__ import annotations

from collections import OrderedDict, deque, namedtuple

import pytest
import torch
from torch.utils._pytree import tree_flatten

from runtime.tensor_tree import tensors_in

a, b, c = torch.zeros(1), torch.ones(2), torch.arange(3)
Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize("tree", [
    a,
    (a, b, 1, None, "s", 2.5),
    ((a, [b, (c, a)]), {"dim": 1, "out": b}),
    [Pair(a, [b, c]), OrderedDict(k=c, j=a)],
    {"z": deque([c, b]), "a": {"n": (a,)}},
    ((), [], {}, None),
], ids=["tensor", "flat", "nested-args-kwargs", "namedtuple-ordereddict", "deque-dict", "empty"])
def test_the_tensors_and_their_order_are_pytrees(tree):
    expected = [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
    assert [id(x) for x in tensors_in(tree)] == [id(x) for x in expected]
