"""The serving copy of an encoder: an ONNX Runtime session or a traced, frozen TorchScript graph,
each checked against eager.

A small tower answering one query spends most of its forward in per-operator dispatch, not in
arithmetic (the default ViT: ~60 operators of 64 tokens x 64 channels), which ONNX Runtime's fused
kernels and a frozen TorchScript graph cut (figures: docs/results.md §23). `optimize_for_inference`
(MKL-DNN convolutions) is not used: it is slower for one image, the case that sets single-request
latency.

Backends are tried in order (`BACKENDS`: ONNX Runtime on CPU, then TorchScript); a copy is
accepted only if it matches the eager encoder on a probe batch (max |dz| <= PROBE_TOL on unit
vectors, batch sizes 1 and 3, another size than the export's); otherwise, or if export fails or
onnxruntime is not installed, the next one is tried, and serving keeps the eager encoder last.
"""

from __future__ import annotations

import io
import logging
import time
import warnings

import numpy as np
import torch

from training.encoder import Encoder

logger = logging.getLogger(__name__)

__all__ = ["InferenceEncoder", "PROBE_TOL", "BACKENDS"]

#: Largest |z_copy - z_eager| accepted on the probe batch (unit vectors; float32 rounding is ~1e-7).
PROBE_TOL = 1e-4
#: Serving backends in order of preference (onnxruntime only for CPU encoders).
BACKENDS = ("onnxruntime", "torchscript")
#: ONNX operator set of the export (fused LayerNormalization needs >= 17).
ONNX_OPSET = 17


class InferenceEncoder:
    """`encoder`'s forward for serving: (B, 3, S, S) float32 -> (B, D) float32 unit rows, no grad.

    `kind` says what runs: "onnxruntime", "torchscript" (the traced copy) or "eager" (the module
    itself, when `optimise` is False or every copy was refused). Safe to call from several threads
    (an ONNX Runtime session's `run` and a frozen TorchScript module are both thread-safe).
    """

    def __init__(self, encoder: Encoder, optimise: bool = True, backends: tuple[str, ...] | None = None):
        self.encoder = encoder.eval()  # eval once here, not per call (no train/eval flips while serving)
        self.device = next(encoder.parameters()).device
        self.image_size = encoder.image_size
        self.embed_dim = encoder.embed_dim
        self._module = None  # TorchScript copy
        self._session = None  # ONNX Runtime session
        self.kind = "eager"
        self.build_s = 0.0
        if optimise:
            t0 = time.perf_counter()
            for backend in BACKENDS if backends is None else backends:
                if backend == "onnxruntime" and self.device.type == "cpu":
                    self._session = self._onnx_session()
                elif backend == "torchscript":
                    self._module = self._trace()
                if self._session is not None or self._module is not None:
                    self.kind = backend
                    break
            self.build_s = time.perf_counter() - t0

    def _probe(self) -> torch.Tensor:
        s = self.image_size
        gen = torch.Generator().manual_seed(0)
        return torch.randn(3, 3, s, s, generator=gen).clamp_(-1, 1).to(self.device)  # preprocess range

    def _agrees(self, name: str, forward, probe: torch.Tensor) -> bool:
        """Does `forward` (a batch -> unit embeddings as a tensor) match eager on batches of 1 and 3?"""
        with torch.inference_mode():
            for batch in (probe[:1], probe):  # other batch sizes than the export's (2)
                err = float((forward(batch) - self.encoder(batch)).abs().max())
                if not err <= PROBE_TOL:
                    logger.warning(
                        "%s copy of the encoder differs from eager by %.3g (> %g); not used",
                        name,
                        err,
                        PROBE_TOL,
                    )
                    return False
        return True

    def _trace(self):
        probe = self._probe()
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore"
                )  # TracerWarnings about the input-shape check (always true here)
                traced = torch.jit.trace(self.encoder, probe[:2], check_trace=False)
                module = torch.jit.freeze(traced.eval())
            return module if self._agrees("TorchScript", module, probe) else None
        except Exception as err:  # noqa: BLE001 - any tracing failure: the eager encoder still serves
            logger.warning("cannot trace the encoder (%s: %s)", type(err).__name__, err)
            return None

    def _onnx_session(self):
        """An ONNX Runtime session of the encoder exported with a dynamic batch axis (None if unavailable)."""
        try:
            import onnxruntime as ort
        except ImportError:
            logger.info("onnxruntime is not installed; serving encoder falls back to TorchScript")
            return None
        probe = self._probe()
        try:
            buffer = io.BytesIO()
            # with grad enabled: under no_grad nn.MultiheadAttention takes its fused fast path
            # (aten::_native_multi_head_attention), which has no ONNX export; ONNX Runtime fuses it anyway
            with torch.enable_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # exporter deprecation and tracer warnings
                torch.onnx.export(
                    self.encoder,
                    (probe[:2],),
                    buffer,
                    input_names=["pixels"],
                    output_names=["embedding"],
                    opset_version=ONNX_OPSET,
                    dynamo=False,
                    dynamic_axes={"pixels": {0: "batch"}, "embedding": {0: "batch"}},
                )
            options = ort.SessionOptions()
            options.intra_op_num_threads = max(1, torch.get_num_threads())  # the same budget as torch's
            options.inter_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            # idle pool threads sleep instead of spinning: the process shares its cores with batch threads
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.log_severity_level = 3
            session = ort.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])

            def forward(batch: torch.Tensor) -> torch.Tensor:
                return torch.from_numpy(session.run(None, {"pixels": batch.numpy()})[0])

            return session if self._agrees("ONNX Runtime", forward, probe) else None
        except Exception as err:  # noqa: BLE001 - export or session failure: the next backend serves
            logger.warning("cannot export the encoder to ONNX Runtime (%s: %s)", type(err).__name__, err)
            return None

    def __call__(self, x: torch.Tensor) -> np.ndarray:
        """Unit embeddings of a preprocessed batch (float32, C-contiguous)."""
        if x.shape[0] == 0:
            return np.zeros((0, self.embed_dim), dtype=np.float32)
        if self._session is not None:
            pixels = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
            return np.ascontiguousarray(self._session.run(None, {"pixels": pixels})[0], dtype=np.float32)
        with torch.inference_mode():
            x = x.to(device=self.device, dtype=torch.float32)
            z = (self._module if self._module is not None else self.encoder)(x)
            return np.ascontiguousarray(z.float().cpu().numpy())
