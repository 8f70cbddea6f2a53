"""The lexical half of search: BM25 over texts (an index's documents), with terms for every script.

Terms (`terms`): the text NFKC-folded and lower-cased; each run of Chinese, Japanese or Korean
characters as its characters and its overlapping character bigrams, since those scripts put no
spaces between words (Lucene's CJKAnalyzer emits the bigrams; with the characters too, MRR@10 on
the Chinese set of docs/performance.md rose from 0.22 to 0.25); any other run of two or more
letters, digits and `_` as one word (`read_file` stays whole), as bm25s's and scikit-learn's
tokenizers cut English, less Lucene's 33 English stop words.

Scores: BM25 as Lucene computes it (Robertson et al. 1994; Kamphuis et al. 2020 name the
variants), for a text d and each query term t, summed over the query's terms:
    idf(t) * tf / (tf + k1 * (1 - b + b * |d| / avgdl)),
    idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))
The index keeps raw term counts, not scores: adding texts (`embed.py index --append`) changes N,
df and avgdl for every text, and weights computed at search time stay right without a rebuild.

A lexical index is a folder of .npy files (docs/embed.md):
    terms.npy    (T,) int64, sorted: each term's hash, the first 8 bytes of its UTF-8 BLAKE2b
                 (fixed width, whatever a term's length; np.searchsorted finds a query's)
    indptr.npy   (T + 1,) int64: term i's postings are [indptr[i], indptr[i + 1])
    texts.npy    (P,) int32: each posting's text, ascending within a term
    counts.npy   (P,) int32: how often the term occurs in that text
    lengths.npy  (N,) int32: each text's number of terms
"""
import hashlib
import os
import re
import unicodedata

import numpy as np

from toolkit.cli import CLIError
from toolkit.files import make_folder, save_array

K1, B = 1.5, 0.75  # bm25s's defaults (Lucene's k1 is 1.2): docs/performance.md, Retrieval
CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"  # kana, Han, Hangul
RUN = re.compile(f"([{CJK}]+)|[^\\W{CJK}]{{2,}}")
# Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET
STOP_WORDS = frozenset("a an and are as at be but by for if in into is it no not of on or such "
                       "that the their then there these they this to was will with".split())
FILES = ("terms", "indptr", "texts", "counts", "lengths")  # each NAME.npy


def terms(text: str) -> list[str]:
    """The terms BM25 counts in text (the module's docstring says how they are cut)."""
    found = []
    for match in RUN.finditer(unicodedata.normalize("NFKC", text).casefold()):
        run = match.group()
        if match.group(1) is None:
            if run not in STOP_WORDS:
                found.append(run)
        else:
            found += [*run, *(run[i:i + 2] for i in range(len(run) - 1))]
    return found


def term_hash(term: str) -> int:
    return int.from_bytes(hashlib.blake2b(term.encode(), digest_size=8).digest(), "little",
                          signed=True)


class Postings:
    """Term counts of texts, gathered as the texts come (a batch at a time), and written as a
    lexical index folder. Memory: three 4-byte numbers per distinct term of a text, and the
    vocabulary of the texts added."""

    def __init__(self, lexical: "Lexical | None" = None):
        """Start empty, or from an existing index's counts (embed.py index --append)."""
        self.vocabulary: dict[str, int] = {}  # a new term -> its id, after the index's terms
        self.hashes = np.zeros(0, np.int64) if lexical is None else np.asarray(lexical.terms)
        self.parts: list[tuple[np.ndarray, ...]] = []  # (text, term id, count) of each batch
        self.lengths: list[np.ndarray] = []
        if lexical is not None:
            term_ids = np.repeat(np.arange(len(self.hashes), dtype=np.int32),
                                 np.diff(lexical.indptr))
            self.parts.append((np.asarray(lexical.texts), term_ids, np.asarray(lexical.counts)))
            self.lengths.append(np.asarray(lexical.lengths))
        self.texts = sum(map(len, self.lengths))

    def add(self, texts: list[str]) -> None:
        """Count the terms of the next texts (numbered on from those added before)."""
        first, known = len(self.hashes), self.vocabulary
        text_ids, term_ids, lengths = [], [], []
        for number, text in enumerate(texts, start=self.texts):
            ids = [known.setdefault(t, first + len(known)) for t in terms(text)]
            text_ids += [number] * len(ids)
            term_ids += ids
            lengths.append(len(ids))
        keys, counts = np.unique((np.array(text_ids, np.int64) << 32) | term_ids,
                                 return_counts=True)
        self.parts.append(((keys >> 32).astype(np.int32), (keys & 0xFFFFFFFF).astype(np.int32),
                           counts.astype(np.int32)))
        self.lengths.append(np.array(lengths, dtype=np.int32))
        self.texts += len(texts)

    def write(self, folder: str) -> None:
        """The lexical index folder (FILES)."""
        make_folder(folder)
        for name, array in self.arrays().items():
            save_array(os.path.join(folder, name + ".npy"), array)

    def arrays(self) -> dict[str, np.ndarray]:
        """The lexical index's arrays by name: the terms' hashes sorted, each term's postings by
        text."""
        if self.texts >= 2**31:
            raise CLIError("a lexical index holds at most 2**31 - 1 documents; build this one "
                           "with --mode dense")
        new = sorted(self.vocabulary, key=self.vocabulary.get)
        new_hashes = np.array([term_hash(t) for t in new], dtype=np.int64)
        hashes, term_ids = np.unique(np.concatenate([self.hashes, new_hashes]),
                                     return_inverse=True)
        text_ids, ids, counts = (np.concatenate(column) for column in zip(*self.parts)) \
            if self.parts else (np.zeros(0, np.int32),) * 3
        ids = term_ids.astype(np.int32)[ids]
        order = np.lexsort((text_ids, ids))
        indptr = np.zeros(len(hashes) + 1, dtype=np.int64)
        np.cumsum(np.bincount(ids, minlength=len(hashes)), out=indptr[1:])
        return {"terms": hashes.astype(np.int64), "indptr": indptr,
                "texts": text_ids[order].astype(np.int32),
                "counts": counts[order].astype(np.int32),
                "lengths": np.concatenate([np.zeros(0, np.int32), *self.lengths])}


class Lexical:
    """A lexical index opened for search: its arrays memory-mapped, read only where a query's
    terms point."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        """arrays: Postings.arrays(), or the files of a lexical index (memory-mapped)."""
        self.terms, self.indptr = arrays["terms"], arrays["indptr"]
        self.texts, self.counts = arrays["texts"], arrays["counts"]
        self.lengths = arrays["lengths"]
        self.average_length = max(float(np.mean(self.lengths)), 1.0) if len(self.lengths) else 1.0

    def scores(self, query: str) -> tuple[np.ndarray, np.ndarray]:
        """(texts, their BM25 scores) of the texts holding a term of query, ascending; none:
        empty arrays."""
        ids = self.term_ids(terms(query))
        starts, ends = self.indptr[ids], self.indptr[ids + 1]
        df = ends - starts
        idf = np.log1p((len(self.lengths) - df + 0.5) / (df + 0.5))
        texts = np.concatenate([np.zeros(0, np.int32)] +
                               [self.texts[s:e] for s, e in zip(starts, ends)])
        counts = np.concatenate([np.zeros(0, np.int32)] +
                                [self.counts[s:e] for s, e in zip(starts, ends)])
        norm = K1 * (1 - B + B * self.lengths[texts] / self.average_length)
        weights = np.repeat(idf, df) * counts / (counts + norm)
        scores = np.bincount(texts, weights=weights, minlength=len(self.lengths))
        found = np.flatnonzero(scores)  # (every weight is above 0)
        return found, scores[found].astype(np.float32)

    def idf(self, words: list[str]) -> dict[str, float]:
        """The idf of each of words the index holds."""
        ids = self.term_ids(words)
        df = self.indptr[ids + 1] - self.indptr[ids]
        known = [w for w in words if self.term_ids([w]).size]
        return dict(zip(known, np.log1p((len(self.lengths) - df + 0.5) / (df + 0.5)).tolist()))

    def term_ids(self, words: list[str]) -> np.ndarray:
        """The indexed terms among words, as positions in terms.npy (once for each time a word
        occurs, as BM25 sums a repeated query term again)."""
        if not words or not len(self.terms):
            return np.zeros(0, np.int64)
        query = np.array([term_hash(w) for w in words], dtype=np.int64)
        place = np.searchsorted(self.terms, query).clip(max=len(self.terms) - 1)
        return place[self.terms[place] == query].astype(np.int64)
