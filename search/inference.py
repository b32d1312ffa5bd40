"""The serving copy of an encoder: traced and frozen TorchScript, checked against eager.

A small tower answering one query spends much of its forward in Python module dispatch (the
32-pixel ResNet of configs/folder.toml: 77 module calls per image). A traced, frozen graph runs
the same kernels without it: CPU time per single-image forward 1.2-1.3x lower for that ResNet and
1.6-1.8x for the default ViT (one thread, medians of interleaved runs). `optimize_for_inference`
(MKL-DNN convolutions) was measured too: 5-10 % faster from batches of 4, but slower for one
image, the case that sets single-request latency, so it is not used.
The copy is accepted only if it matches the eager encoder on a probe batch (max |dz| <= PROBE_TOL
on unit vectors, batch sizes 1 and 3); otherwise, or if tracing fails, serving keeps the eager one.
"""
from __future__ import annotations

import logging
import time
import warnings

import numpy as np
import torch

from training.encoder import Encoder

logger = logging.getLogger(__name__)

__all__ = ["InferenceEncoder", "PROBE_TOL"]

#: Largest |z_traced - z_eager| accepted on the probe batch (unit vectors; float32 rounding is ~1e-7).
PROBE_TOL = 1e-4


class InferenceEncoder:
    """`encoder`'s forward for serving: (B, 3, S, S) float32 -> (B, D) float32 unit rows, no grad.

    `kind` says what runs: "torchscript" (the traced copy) or "eager" (the module itself, when
    `optimise` is False or the traced copy was refused). Safe to call from several threads.
    """

    def __init__(self, encoder: Encoder, optimise: bool = True):
        self.encoder = encoder.eval()   # eval once here, not per call (no train/eval flips while serving)
        self.device = next(encoder.parameters()).device
        self.image_size = encoder.image_size
        self.embed_dim = encoder.embed_dim
        self._module = None
        self.kind = "eager"
        self.build_s = 0.0
        if optimise:
            t0 = time.perf_counter()
            self._module = self._trace()
            self.build_s = time.perf_counter() - t0
            if self._module is not None:
                self.kind = "torchscript"

    def _trace(self):
        s = self.image_size
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(3, 3, s, s, generator=gen).clamp_(-1, 1).to(self.device)  # preprocess range
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TracerWarnings about the input-shape check (always true here)
                traced = torch.jit.trace(self.encoder, probe[:2], check_trace=False)
                module = torch.jit.freeze(traced.eval())
                with torch.inference_mode():
                    for batch in (probe[:1], probe):   # another batch size than the trace's
                        err = float((module(batch) - self.encoder(batch)).abs().max())
                        if not err <= PROBE_TOL:
                            logger.warning("traced encoder differs from eager by %.3g (> %g); serving eager",
                                           err, PROBE_TOL)
                            return None
        except Exception as err:  # noqa: BLE001 - any tracing failure: the eager encoder still serves
            logger.warning("cannot trace the encoder (%s: %s); serving eager", type(err).__name__, err)
            return None
        return module

    def __call__(self, x: torch.Tensor) -> np.ndarray:
        """Unit embeddings of a preprocessed batch (float32, C-contiguous)."""
        if x.shape[0] == 0:
            return np.zeros((0, self.embed_dim), dtype=np.float32)
        with torch.inference_mode():
            x = x.to(device=self.device, dtype=torch.float32)
            z = (self._module if self._module is not None else self.encoder)(x)
            return np.ascontiguousarray(z.float().cpu().numpy())
