"""The CUDA-graph stand-in (tests/cuda_graphs.py) does what a CUDA-graph tree does to compiled functions' outputs, and
`compile_function`'s copies are what survive it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from captioner.models.compiling import compile_function
from tests.cuda_graphs import StaleOutput, cuda_graph_stand_in


class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        return x, self.weight, (state[0] * self.weight + x, state[1] + 1, state[1] > 0)


def test_a_call_overwrites_the_outputs_of_the_call_before_it_from_any_compiled_function():
    with cuda_graph_stand_in() as stand_in:
        step = Step()
        first, second = torch.compile(step.forward), torch.compile(lambda x: x * 2)
        x = torch.ones(3)
        same_x, weight, (h, count, positive) = first(x, (torch.zeros(3), torch.tensor([0, 1, 2])))
        assert torch.equal(h, torch.ones(3)) and count.tolist() == [1, 2, 3]
        assert positive.tolist() == [False, True, True]
        doubled = second(torch.ones(2))  # another function: the same pool
        assert torch.isnan(h).all()  # floats: NaN
        assert count.tolist() == [~1, ~2, ~3]  # integers: their bits inverted
        assert positive.tolist() == [True, False, False]  # booleans: negated
        # what is not pool memory is left as it was: an input returned, a parameter
        assert same_x is x and torch.equal(x, torch.ones(3)) and torch.equal(weight, torch.ones(3))
        assert torch.equal(step.weight, torch.ones(3))
        assert torch.equal(doubled, torch.full((2,), 2.0))  # the last call's outputs stand until the next call
    assert stand_in.calls == 2 and stand_in.overwritten == 3


def test_an_input_that_is_the_call_before_its_output_raises_naming_it():
    with cuda_graph_stand_in():
        step = Step()
        compiled = torch.compile(step.forward)
        _, _, state = compiled(torch.ones(3), (torch.zeros(3), torch.zeros(3, dtype=torch.long)))
        with pytest.raises(StaleOutput, match=r"input args\[1\]\[0\] \(3,\) is an output of the call before it"):
            compiled(torch.ones(3), (state[0], state[1]))
        with pytest.raises(StaleOutput, match=r"args\[1\]\[1\]"):  # a view of one is the same memory
            compiled(torch.ones(3), (torch.zeros(3), state[1][:2].view(2)))


def test_compile_function_copies_its_outputs_out_of_the_pool():
    """The project's rule: what a compiled call returns is a copy, which the next call's replay leaves alone and which
    can be fed back. Without the copies the same loop fails (the test above)."""
    with cuda_graph_stand_in() as stand_in:
        step = Step()
        compiled = compile_function(step.forward)
        state = (torch.zeros(3), torch.zeros(3, dtype=torch.long))
        kept = []
        for _ in range(4):
            _, _, (h, count, _) = compiled(torch.ones(3), state)
            state = (h, count)
            kept.append(h)
        assert [k.tolist() for k in kept] == [[1.0] * 3, [2.0] * 3, [3.0] * 3, [4.0] * 3]
    assert stand_in.overwritten == 3 * 3  # the pool's outputs were overwritten, the copies were not
