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


def test_copy_out_copies_the_tensors_in_dicts_and_refuses_what_it_cannot_copy():
    """A compiled function's outputs are copied out of the graph's memory wherever they are: in a dict too (passed
    through as it is, its tensors would be left in memory the next replay overwrites); an object it cannot look into
    is refused, not passed through."""
    from captioner.models.compiling import copy_out

    tensor = torch.ones(3)
    copied = copy_out({"loss": tensor, "parts": [tensor], "steps": 4})
    assert copied["loss"] is not tensor and torch.equal(copied["loss"], tensor) and copied["steps"] == 4
    assert copied["parts"][0].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()

    class Holder:
        pass

    with pytest.raises(TypeError, match="of type Holder is not copied out"):
        copy_out(Holder())


@pytest.mark.parametrize("per_thread", [True, False], ids=["per thread (this torch)", "the process's (torch 2.7)"])
def test_the_recompile_limit_holds_while_any_thread_is_inside_and_is_put_back_after_the_last(monkeypatch, per_thread):
    """Dynamo's recompile limit is each thread's own in this torch, and the process's in older ones (emulated here by
    a setting that every thread shares): with two threads inside `recompile_limit` at once, each compiles under the
    raised limit whichever leaves first, and the setting is put back after the last."""
    import threading
    from types import SimpleNamespace

    from captioner.models import compiling
    from captioner.models.compiling import RECOMPILE_LIMIT, recompile_limit

    if not per_thread:  # one setting for every thread
        monkeypatch.setattr(torch._dynamo, "config", SimpleNamespace(recompile_limit=8))
    monkeypatch.setattr(compiling, "_limit_is_per_thread", lambda: per_thread)
    config = torch._dynamo.config
    before = config.recompile_limit
    assert before < RECOMPILE_LIMIT
    inside, leave, seen = threading.Event(), threading.Event(), []

    def other():
        with recompile_limit():
            inside.set()
            leave.wait(10)
            seen.append(config.recompile_limit)

    thread = threading.Thread(target=other)
    with recompile_limit():
        thread.start()
        assert inside.wait(10)
        assert config.recompile_limit == RECOMPILE_LIMIT
    leave.set()  # this thread has left; the other is still inside
    thread.join(10)
    assert seen == [RECOMPILE_LIMIT] and config.recompile_limit == before


def test_whether_the_limit_is_each_thread_s_own_is_found_by_asking_a_thread():
    import threading

    from captioner.models.compiling import _limit_is_per_thread

    config = torch._dynamo.config
    before, seen = config.recompile_limit, []
    config.recompile_limit = before + 5
    try:
        reader = threading.Thread(target=lambda: seen.append(config.recompile_limit))
        reader.start()
        reader.join()
    finally:
        config.recompile_limit = before
    assert _limit_is_per_thread() == (seen != [before + 5]) and config.recompile_limit == before
