"""Does a synthetic set look like the real data? Distances to held-out real text and a downstream task.

Every figure is reported beside the same figure for a *real* set of the same size (training records,
size-matched) against the same held-out records, so a reader sees what a perfect generator would score:

* ``ngram_js``: Jensen-Shannon divergence (bits, 0 … 1) between the word n-gram frequency distributions
  (n = 1, 2; words are ``\\w+`` runs and single punctuation marks, so code tokenises sensibly);
* ``frechet``: Fréchet distance between Gaussians fitted to embeddings (Heusel et al. 2017's FID, here on
  text): the mean-pooled last hidden states of a fixed public model (:func:`model_embedder`; the run's
  base model or the study's pretrained public model), or TF-IDF + LSA (:func:`lsa_embedder`, fitted on
  the real records only, so every synthetic set lands in the same space);
* ``downstream``: a TF-IDF + logistic-regression classifier of the label (``data.label_column``)
  trained on the synthetic records and tested on the held-out real records, against the same
  classifier trained on the real training records (and the majority-class rate).

MAUVE is not computed: its package (mauve-text 0.4) needs faiss and, by default, downloads GPT-2 large.

Example:
    >>> round(ngram_js(["a b c"], ["a b c"], n=1), 6), round(ngram_js(["a a"], ["b b"], n=1), 6)
    (0.0, 1.0)
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Optional, Sequence

import numpy as np

_WORD = re.compile(r"\w+|[^\w\s]")


def _ngrams(texts: Sequence[str], n: int) -> Counter:
    c: Counter = Counter()
    for t in texts:
        w = _WORD.findall(t)
        c.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
    return c


def ngram_js(a: Sequence[str], b: Sequence[str], *, n: int) -> float:
    """Jensen-Shannon divergence (base 2) between the word ``n``-gram distributions of two text sets."""
    from scipy.spatial.distance import jensenshannon

    ca, cb = _ngrams(a, n), _ngrams(b, n)
    keys = sorted(set(ca) | set(cb))
    if not ca or not cb:
        return 1.0
    p = np.array([ca[k] for k in keys], dtype=float)
    q = np.array([cb[k] for k in keys], dtype=float)
    return float(jensenshannon(p / p.sum(), q / q.sum(), base=2) ** 2)


def frechet_distance(x: np.ndarray, y: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to the rows of ``x`` and ``y``.

    ``|μx - μy|² + tr(Σx + Σy - 2 (Σx Σy)^½)``; the matrix square root's tiny imaginary part from rounding is
    dropped.
    """
    from scipy import linalg

    mx, my = x.mean(0), y.mean(0)
    cx, cy = np.atleast_2d(np.cov(x, rowvar=False)), np.atleast_2d(np.cov(y, rowvar=False))
    root, _ = linalg.sqrtm(cx @ cy, disp=False)
    if not np.isfinite(root).all():  # singular product: regularise both as FID implementations do
        eps = 1e-6 * np.eye(len(cx))
        root = linalg.sqrtm((cx + eps) @ (cy + eps))
    return float(max(0.0, ((mx - my) ** 2).sum() + np.trace(cx + cy - 2 * np.real(root))))


def lsa_embedder(real: Sequence[str], *, dim: int = 32, seed: int = 0) -> Callable[[Sequence[str]], np.ndarray]:
    """TF-IDF (word 1-2-grams) + truncated SVD, fitted on ``real`` only; returns ``texts -> (N, dim)``."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.pipeline import make_pipeline

    tfidf = TfidfVectorizer(token_pattern=_WORD.pattern, ngram_range=(1, 2), sublinear_tf=True, min_df=2)
    n_features = tfidf.fit(real).transform(real).shape[1]
    pipe = make_pipeline(tfidf, TruncatedSVD(n_components=max(2, min(dim, n_features - 1, len(real) - 1)),
                                             random_state=seed)).fit(real)
    return lambda texts: pipe.transform(list(texts))


def model_embedder(path: str, *, max_length: int = 128, batch_size: int = 32) -> Callable[[Sequence[str]], np.ndarray]:
    """Mean-pooled last hidden states of the causal LM at ``path`` (a checkpoint, run or HF model directory)."""
    import torch

    from dpllm.checkpoint import load_model

    model, tok = load_model(path, merge=True)

    @torch.no_grad()
    def embed(texts: Sequence[str]) -> np.ndarray:
        rows = []
        for lo in range(0, len(texts), batch_size):
            enc = tok([t or " " for t in texts[lo:lo + batch_size]], truncation=True, max_length=max_length,
                      padding=True, return_tensors="pt")
            h = model(**enc, output_hidden_states=True).hidden_states[-1]
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            rows.append(((h * m).sum(1) / m.sum(1).clamp(min=1)).float().numpy())
        return np.concatenate(rows)

    return embed


def downstream(train_texts: Sequence[str], train_labels: Sequence[str], test_texts: Sequence[str],
               test_labels: Sequence[str], *, seed: int = 0) -> Optional[float]:
    """Test accuracy of TF-IDF (character 2-4-grams) + logistic regression; None if training has one class."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    if len(set(train_labels)) < 2:
        return None
    clf = make_pipeline(TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True),
                        LogisticRegression(max_iter=2000, random_state=seed))
    clf.fit(list(train_texts), list(train_labels))
    return float(np.mean(clf.predict(list(test_texts)) == np.asarray(test_labels)))


def fidelity(synthetic: Sequence[str], train: Sequence[str], heldout: Sequence[str], *,
             embed: Callable[[Sequence[str]], np.ndarray], embedder: str,
             synthetic_labels: Optional[Sequence[str]] = None, train_labels: Optional[Sequence[str]] = None,
             heldout_labels: Optional[Sequence[str]] = None, seed: int = 0) -> dict:
    """Fidelity of ``synthetic`` to ``heldout``, beside a size-matched real reference drawn from ``train``.

    Args:
        synthetic, train, heldout: texts without control codes.
        embed: ``texts -> (N, d)`` (:func:`model_embedder` or :func:`lsa_embedder`); embedder names it.
        synthetic_labels, train_labels, heldout_labels: classes for the downstream task (all or none).
        seed: the reference subsample and the classifier.

    Returns:
        ``{"synthetic": {...}, "real_reference": {...}, "embedder", "n_reference"}``, each side with
        ``ngram_js_1``, ``ngram_js_2``, ``frechet``, and ``downstream_accuracy`` when labels are given
        (plus ``majority_accuracy``).
    """
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(train), size=min(len(train), len(synthetic)), replace=False)
    reference = [train[i] for i in pick]
    h = embed(list(heldout))
    out: dict = {"embedder": embedder, "n_reference": len(reference)}
    for side, texts in (("synthetic", list(synthetic)), ("real_reference", reference)):
        out[side] = {"ngram_js_1": ngram_js(texts, heldout, n=1), "ngram_js_2": ngram_js(texts, heldout, n=2),
                     "frechet": frechet_distance(embed(texts), h)}
    if synthetic_labels is not None and train_labels is not None and heldout_labels is not None:
        out["synthetic"]["downstream_accuracy"] = downstream(synthetic, synthetic_labels, heldout, heldout_labels,
                                                             seed=seed)
        out["real_reference"]["downstream_accuracy"] = downstream(reference, [train_labels[i] for i in pick],
                                                                  heldout, heldout_labels, seed=seed)
        out["real_train_all_accuracy"] = downstream(train, train_labels, heldout, heldout_labels, seed=seed)
        top = Counter(heldout_labels).most_common(1)[0][1]
        out["majority_accuracy"] = top / len(heldout_labels)
    return out
