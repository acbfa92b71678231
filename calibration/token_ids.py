"""Token-id calibration samples for transformer encoders (BERT-style int64 inputs).

SYNTHETIC DATA: ../shared/calibration holds no text corpus and no tokenizer vocabulary, so these
readers make token sequences with the *structure* a tokenizer gives (what matters for activation
ranges): ``[CLS] tokens [SEP] (tokens [SEP]) [PAD]...``, a sequence length that varies from a few
tokens to the full input, an attention mask of 1 over the tokens and 0 over the padding, segment
ids 0/1, and word-piece ids drawn from a Zipf-like distribution (frequent pieces more often), as
in real text. The figures a report shows for these models are measured on such sequences.

Reader contract (see ``pipeline/calibration/samples.py``): ``fn(calibration_path, specs)`` yields
``{input name: array}``; input names are matched by role (ids, mask, segments), so one reader
serves exports that name them ``input_ids``/``attention_mask``/``token_type_ids`` or
``input_mask``/``segment_ids``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

SAMPLES = 64
SEED = 20261122


def _role(name: str) -> str:
    lowered = name.lower()
    if "mask" in lowered:
        return "mask"
    if "type" in lowered or "segment" in lowered:
        return "segments"
    return "ids"


def _sequences(
    specs: list[Any], vocab: int, cls: int, sep: int, pad: int, first_piece: int
) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(SEED)
    length = int(specs[0].shape[-1])
    pieces = np.arange(first_piece, vocab)
    weights = 1.0 / np.arange(1, pieces.size + 1)  # Zipf: frequent word pieces dominate text
    weights /= weights.sum()
    for _ in range(SAMPLES):
        used = int(rng.integers(min(4, length), length + 1))
        tokens = rng.choice(pieces, size=used, p=weights)
        tokens[0], tokens[used - 1] = cls, sep
        segments = np.zeros(length, np.int64)
        if used >= 8 and rng.random() < 0.5:  # a sentence pair: [CLS] a [SEP] b [SEP]
            split = int(rng.integers(2, used - 2))
            tokens[split] = sep
            segments[split + 1 : used] = 1
        ids = np.full(length, pad, np.int64)
        ids[:used] = tokens
        mask = np.zeros(length, np.int64)
        mask[:used] = 1
        values = {"ids": ids, "mask": mask, "segments": segments}
        yield {s.name: values[_role(s.name)].reshape(s.shape).astype(s.dtype) for s in specs}


def read_bert_uncased(path: Path | None, specs: list[Any]) -> Iterator[dict[str, np.ndarray]]:
    """bert-base-uncased vocabulary layout (DistilBERT, BERT): 30522 ids, [PAD]=0, [CLS]=101,
    [SEP]=102, word pieces from 1996 on (the ids below are special and unused tokens)."""
    yield from _sequences(specs, vocab=30522, cls=101, sep=102, pad=0, first_piece=1996)


def read_toy_vocab(path: Path | None, specs: list[Any]) -> Iterator[dict[str, np.ndarray]]:
    """A 99-token test vocabulary (onnxruntime's bert_toy models): [PAD]=0, [CLS]=1, [SEP]=2."""
    yield from _sequences(specs, vocab=99, cls=1, sep=2, pad=0, first_piece=5)
