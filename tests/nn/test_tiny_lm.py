"""examples/tiny_lm.py: a short training run lowers the loss clearly; cached sampling is exact."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tiny_lm.py"
SMALL = {"embed_dim": 32, "num_layers": 1}


@pytest.fixture(scope="module")
def tiny_lm():
    spec = importlib.util.spec_from_file_location("tiny_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the example's annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_short_training_lowers_the_loss(tiny_lm):
    run = tiny_lm.train(30, batch=8, seq=32, lr=2e-2, config=SMALL, seed=0)
    assert len(run.losses) == 30 and np.all(np.isfinite(run.losses))
    first, last = run.losses[0], float(np.mean(run.losses[-5:]))
    assert first == pytest.approx(np.log(len(run.vocabulary)), abs=0.5)  # an untrained model guesses
    assert last < first - 1.0, (first, last)
    text = tiny_lm.sample(run.model, run.vocabulary, "The sea", 40, seed=1)
    assert text.startswith("The sea") and len(text) == 47
    assert set(text) <= set(run.vocabulary.chars)


def test_cached_decoding_equals_recomputation(tiny_lm):
    run = tiny_lm.train(3, batch=2, seq=16, config={**SMALL, "num_layers": 2, "dtype": "float64"}, seed=1)
    model, vocabulary = run.model, run.vocabulary
    model.train(False)
    ids = vocabulary.encode("the keeper lit the lamp")[None]
    full = model.forward(ids)
    caches = model.new_caches(batch=1, max_seq=ids.shape[1])
    prefill = model.forward(ids[:, :6], caches)
    assert np.max(np.abs(prefill - full[:, :6])) < 1e-10
    for position in range(6, ids.shape[1]):
        step = model.forward(ids[:, position : position + 1], caches)
        assert np.max(np.abs(step[0, 0] - full[0, position])) < 1e-10
    greedy = tiny_lm.sample(model, vocabulary, "The", 5, temperature=0)
    for index in range(5):
        logits = model.forward(vocabulary.encode(greedy[: 3 + index])[None])
        assert vocabulary.chars[int(np.argmax(logits[0, -1]))] == greedy[3 + index]


def test_unknown_characters_are_refused(tiny_lm):
    vocabulary = tiny_lm.Vocabulary("abc")
    with pytest.raises(ValueError, match=r"text: expected characters of the training text, received \['z'\]"):
        vocabulary.encode("abz")
