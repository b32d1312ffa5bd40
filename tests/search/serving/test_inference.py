"""InferenceEncoder (the serving forward: ONNX Runtime, TorchScript) against the eager encoder it copies."""

from __future__ import annotations

import builtins
import threading

import numpy as np
import pytest
import torch

import search.serving.inference as inference
from search.serving.inference import InferenceEncoder
from training.encoder import EncoderConfig, create_encoder, embed

TOWERS = {
    "vit": dict(image_size=32, width=32, layers=2, heads=2, patch_size=8, embed_dim=16),
    "resnet": dict(image_size=32, width=32, layers=(1, 1, 1, 1), heads=4, embed_dim=24),
    "vit-renormalised": dict(
        image_size=16,
        width=32,
        layers=1,
        heads=2,
        patch_size=4,
        embed_dim=8,
        image_mean=(0.4, 0.45, 0.5),
        image_std=(0.2, 0.25, 0.3),
    ),
    # the folder config's served embedding: tower + grey pixels + colour histogram, centres fitted
    "resnet-anchored": dict(
        image_size=32,
        width=32,
        layers=(1, 1, 1, 1),
        heads=4,
        embed_dim=24,
        pixel_weight=0.3,
        colour_weight=0.3,
        colour_bins=8,
    ),
    # ... and gradient-orientation histograms (a max, comparisons, a pooled sum)
    "resnet-anchored-gradient": dict(
        image_size=32,
        width=32,
        layers=(1, 1, 1, 1),
        heads=4,
        embed_dim=24,
        pixel_weight=0.25,
        colour_weight=0.25,
        gradient_weight=0.25,
        colour_bins=8,
    ),
}


def _encoder(name: str, seed: int = 0):
    torch.manual_seed(seed)
    enc = create_encoder(EncoderConfig(**TOWERS[name]))
    if enc.has_anchor:
        enc.set_pixel_mean([_images(8, enc.image_size, seed=99)])
    return enc


def _images(n: int, size: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


BACKENDS = ["onnxruntime", "torchscript"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(TOWERS))
def test_serving_copy_matches_eager(name, backend):
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    enc = _encoder(name)
    fast = InferenceEncoder(enc, backends=(backend,))
    assert fast.kind == backend
    for n in (1, 5, 17):  # batch sizes other than the trace's (2)
        x = _images(n, enc.image_size, seed=n)
        ref = embed(enc, x, progress=False)
        z = fast(x)
        assert z.dtype == np.float32 and z.shape == (n, enc.embed_dim) and z.flags.c_contiguous
        np.testing.assert_allclose(z, ref, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-5)
    assert fast(_images(0, enc.image_size)).shape == (0, enc.embed_dim)


def test_default_prefers_onnxruntime_then_torchscript(monkeypatch):
    pytest.importorskip("onnxruntime")
    enc = _encoder("vit")
    assert InferenceEncoder(enc).kind == "onnxruntime"
    real_import = builtins.__import__

    def without_onnxruntime(name, *args, **kwargs):
        if name == "onnxruntime" or name.startswith("onnxruntime."):
            raise ImportError("no onnxruntime here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_onnxruntime)
    fallback = InferenceEncoder(enc)
    assert fallback.kind == "torchscript"
    x = _images(3, enc.image_size)
    np.testing.assert_allclose(fallback(x), embed(enc, x, progress=False), atol=1e-5)


def test_eager_when_not_optimised_or_tracing_fails(monkeypatch):
    enc = _encoder("vit")
    x = _images(4, enc.image_size)
    ref = embed(enc, x, progress=False)
    plain = InferenceEncoder(enc, optimise=False)
    assert plain.kind == "eager"
    np.testing.assert_array_equal(plain(x), ref)

    def broken(*args, **kwargs):
        raise RuntimeError("cannot trace this tower")

    monkeypatch.setattr(torch.jit, "trace", broken)
    monkeypatch.setattr(torch.onnx, "export", broken)
    failed = InferenceEncoder(enc)
    assert failed.kind == "eager"
    np.testing.assert_array_equal(failed(x), ref)


def test_copy_refused_when_it_disagrees(monkeypatch):
    monkeypatch.setattr(inference, "PROBE_TOL", -1.0)  # no copy can be within a negative tolerance
    enc = _encoder("resnet")
    fast = InferenceEncoder(enc)
    assert fast.kind == "eager"
    x = _images(3, enc.image_size)
    np.testing.assert_array_equal(fast(x), embed(enc, x, progress=False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_calls_agree(backend):
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    enc = _encoder("resnet")
    fast = InferenceEncoder(enc, backends=(backend,))
    assert fast.kind == backend
    inputs = [_images(1 + i % 3, enc.image_size, seed=i) for i in range(12)]
    refs = [embed(enc, x, progress=False) for x in inputs]
    out: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        for _ in range(5):
            out[i] = fast(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ref in enumerate(refs):
        np.testing.assert_allclose(out[i], ref, atol=1e-5)
