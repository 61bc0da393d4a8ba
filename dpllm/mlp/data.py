"""Small classification data sets for the MLP smoke studies, as full tensors (no DataLoader needed).

* ``gaussian``: the synthetic task of the scaling-law and privacy-cliff papers: 500 points, 10 features,
  5 balanced classes, one isotropic Gaussian cluster per class with spread 1.5 (the privacy-cliff paper),
  split 80/20.
* ``digits``: scikit-learn's 8×8 handwritten digits (1,797 images, 64 features, 10 classes), which ship
  with scikit-learn, so no download is needed.

Preprocessing never looks at the data: a statistic computed from the private training records (e.g. the
training mean and standard deviation) would be a release that the DP accountant does not count. The
Gaussian features are standardised with the mixture's *population* moments, which follow from the
public generator; digit pixels (0..16) are divided by 16.

Example:
    >>> split = load_dataset("gaussian")
    >>> tuple(split.x_train.shape), tuple(split.x_test.shape), split.n_classes
    ((400, 10), (100, 10), 5)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

DATASETS = ("gaussian", "digits")
DATA_SEED = 42  # both papers generate their data with seed 42


@dataclass
class Split:
    """A train/test split held as tensors.

    Attributes:
        name: data set name (``gaussian`` or ``digits``).
        x_train, y_train, x_test, y_test: float32 features ``[n, d]`` and int64 labels ``[n]``.
        n_classes: number of labels.
        info: how the data were made (recorded in ``results.json``).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int
    info: dict = field(default_factory=dict)

    @property
    def n_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])


def _split(name: str, x: np.ndarray, y: np.ndarray, n_classes: int, test_fraction: float,
           rng: np.random.Generator, info: dict) -> Split:
    order = rng.permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    as_x = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.as_tensor(a, dtype=torch.int64)  # noqa: E731
    return Split(name, as_x(x[train]), as_y(y[train]), as_x(x[test]), as_y(y[test]), n_classes,
                 {**info, "n_train": len(train), "n_test": n_test, "test_fraction": test_fraction})


def gaussian_clusters(*, n_samples: int = 500, n_features: int = 10, n_classes: int = 5, spread: float = 1.5,
                      center_scale: float = 3.0, test_fraction: float = 0.2, seed: int = DATA_SEED) -> Split:
    """Balanced Gaussian clusters: centres ~ N(0, center_scale²·I), points ~ N(centre, spread²·I).

    The scaling-law and privacy-cliff papers describe the task (500 × 10, 5 classes, spread 1.5, "well
    separated") but not how they drew the centres; ``center_scale=3`` is our choice, under which a linear
    classifier reaches ~99% as the papers' baselines do.

    Args:
        n_samples, n_features, n_classes: shape of the task.
        spread: standard deviation of each cluster.
        center_scale: standard deviation of the cluster centres.
        test_fraction: share held out for testing.
        seed: generator seed (the data are the same for every training seed).

    Returns:
        A :class:`Split` with features standardised by the mixture's population mean and std.
    """
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, center_scale, size=(n_classes, n_features))
    y = rng.permutation(np.arange(n_samples) % n_classes)
    x = centers[y] + rng.normal(0.0, spread, size=(n_samples, n_features))
    # Population moments of the equal-weight mixture: known from the generator, not estimated from data.
    mean = centers.mean(axis=0)
    std = np.sqrt(spread**2 + centers.var(axis=0))
    x = (x - mean) / std
    info = {"generator": "centres ~ N(0, center_scale^2 I); x ~ N(centre_y, spread^2 I); "
                         "standardised with population moments",
            "n_samples": n_samples, "n_features": n_features, "n_classes": n_classes, "spread": spread,
            "center_scale": center_scale, "seed": seed}
    return _split("gaussian", x, y, n_classes, test_fraction, rng, info)


def digits(*, test_fraction: float = 0.2, seed: int = DATA_SEED) -> Split:
    """scikit-learn's ``load_digits`` (ships with the package, no download), pixels scaled to [0, 1].

    Args:
        test_fraction: share held out for testing.
        seed: seed of the split.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = bunch.data.astype(np.float64) / 16.0  # pixel intensities are 0..16: a fixed, data-free scale
    y = bunch.target.astype(np.int64)
    info = {"source": "sklearn.datasets.load_digits", "n_samples": len(y), "n_features": x.shape[1],
            "n_classes": 10, "scaling": "pixels / 16", "seed": seed}
    return _split("digits", x, y, 10, test_fraction, np.random.default_rng(seed), info)


def load_dataset(name: str, *, seed: int = DATA_SEED) -> Split:
    """Data set by name.

    Raises:
        ValueError: for a name other than ``gaussian`` or ``digits``.
    """
    if name == "gaussian":
        return gaussian_clusters(seed=seed)
    if name == "digits":
        return digits(seed=seed)
    raise ValueError(f"dataset={name!r} is not known; choose one of {', '.join(DATASETS)}")
