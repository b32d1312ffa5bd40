"""Independent reference generators for the search tests (inline von Mises / label / instance)."""

from __future__ import annotations

import numpy as np
from scipy.special import i0


class VonMises:
    """log r = sum_i kappa cos(t'_i - t_i) - m log I0(kappa), computed by brute force."""

    name = "latent"
    exact = True
    description = "von Mises latent positives (exact r)"

    def __init__(self, kappa: float):
        self.kappa = kappa

    def log_ratio(self, qm, dm):
        qm, dm = np.asarray(qm, float), np.asarray(dm, float)
        d = qm[:, None, :] - dm[None, :, :]
        return (self.kappa * np.cos(d)).sum(-1) - qm.shape[1] * np.log(i0(self.kappa))


class Labels:
    name = "label"
    exact = True
    description = "class-conditional positives (exact r)"

    def log_ratio(self, qm, dm):
        qm, dm = np.asarray(qm), np.asarray(dm)
        pi = {c: np.mean(dm == c) for c in np.unique(dm)}
        out = np.full((len(qm), len(dm)), -np.inf)
        for i, c in enumerate(qm):
            same = dm == c
            if same.any():
                out[i, same] = -np.log(pi[c])
        return out


class Instance:
    name = "instance"
    exact = False
    description = "instance positives: q is a point mass on the source item (approximation)"

    def log_ratio(self, qm, dm):
        qm, dm = np.asarray(qm), np.asarray(dm)
        return np.where(qm[:, None] == dm[None, :], 0.0, -np.inf)


class GenericLatent(VonMises):
    """Same r as VonMises but under another name, so softmax_gap takes the generic tile path."""

    name = "latent-generic"


def oracle(latents):
    latents = np.asarray(latents, float)
    m = latents.shape[1]
    z = np.stack([np.cos(latents), np.sin(latents)], axis=-1).reshape(len(latents), 2 * m)
    return z / np.sqrt(m)


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)
