"""The optional torch.compile of the decoder's per-word methods (`Captioner.load(..., compile_decoder=True)`)."""

import pytest
import torch

from captioner import Captioner
from captioner.data.shapes import ShapesDataset
from captioner.models.decoder import COMPILED_METHODS


@pytest.mark.slow  # about 45 s, most of it compiling
def test_a_compiled_decoder_captions_as_the_eager_one(tiny_model):
    eager = Captioner.load(tiny_model)
    assert not any(name in eager.model.decoder.__dict__ for name in COMPILED_METHODS)
    compiled = Captioner.load(tiny_model, compile_decoder=True)
    decoder = compiled.model.decoder
    methods = [decoder.__dict__[name] for name in COMPILED_METHODS]
    assert decoder.compile_steps() is decoder
    assert [decoder.__dict__[name] for name in COMPILED_METHODS] == methods  # not wrapped a second time
    images = [ShapesDataset("test", 3, seed=0).load_image(i) for i in range(3)]
    for batch in (images[:1], images):  # one image, what the option is for, and several
        want, got = eager.caption(batch, beam_size=3), compiled.caption(batch, beam_size=3)
        assert [r.text for r in got] == [r.text for r in want]
        for a, b in zip(got, want, strict=True):
            assert abs(a.score - b.score) < 1e-4 and torch.allclose(a.alphas, b.alphas, atol=1e-5)
