"""Approximate dense search for large indexes: an HNSW graph (Malkov & Yashunin 2016,
arXiv:1603.09320) from faiss over the index's float16 vectors. The graph holds its own float16
copy of the vectors, and search memory-maps it (faiss's IO_FLAG_MMAP_IFC): opening reads nothing,
and a query reads the few thousand vectors its walk visits. docs/performance.md, Retrieval, has
the figures behind the constants.
"""
from collections.abc import Callable

import faiss
import numpy as np

from toolkit.cli import CLIError
from toolkit.files import atomic_write

M = 32  # neighbours a node links to (64 on the bottom layer)
EF_CONSTRUCTION = 64  # candidates weighed per insertion
EF_SEARCH = 256  # candidates kept per query: at 1M vectors of 768, recall@10 of exact 0.986
# in 3.6 ms (128: 0.947 in 2.7 ms)
BUILD_ROWS = 65536  # vectors read from disk and added at a time


def build(path: str, vectors_path: str, rows: int, dim: int) -> None:
    """The graph of the first rows float16 vectors of a raw file (read block by block with plain
    reads, so the file's pages do not stay in this process's memory), written to path."""
    graph = faiss.IndexHNSWSQ(dim, faiss.ScalarQuantizer.QT_fp16, M, faiss.METRIC_INNER_PRODUCT)
    graph.hnsw.efConstruction = EF_CONSTRUCTION
    graph.train(np.zeros((1, dim), np.float32))  # float16 codes learn nothing, but faiss asks
    for start in range(0, rows, BUILD_ROWS):
        count = min(BUILD_ROWS, rows - start)
        block = np.fromfile(vectors_path, dtype="<f2", count=count * dim, offset=start * dim * 2)
        graph.add(block.reshape(count, dim).astype(np.float32))
    atomic_write(path, lambda tmp: faiss.write_index(graph, tmp))


def open_graph(path: str, rows: int, dim: int, rebuild: str) -> faiss.Index:
    """The graph at path, memory-mapped; one that is not the index's (other rows or width) is
    refused with the rebuild command."""
    try:
        graph = faiss.read_index(path, faiss.IO_FLAG_MMAP_IFC)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else "unreadable"
        raise CLIError(f"cannot read the graph {path} ({reason}); rebuild the index: "
                       f"{rebuild}") from None
    if graph.ntotal != rows or graph.d != dim or not isinstance(graph, faiss.IndexHNSW):
        raise CLIError(f"the graph {path} holds {graph.ntotal:,} vectors of {graph.d}, not the "
                       f"index's {rows:,} of {dim}; rebuild the index: {rebuild}")
    graph.hnsw.efSearch = EF_SEARCH
    return graph


def search_documents(graph: faiss.Index, query: np.ndarray, k: int, wanted: int,
                     best_documents: Callable) -> list:
    """The k best documents of one query vector: the graph's nearest chunks, asked for in
    growing numbers until they hold k distinct documents (or wanted chunks, enough for any)."""
    count = min(wanted, max(4 * k, 16))
    while True:
        graph.hnsw.efSearch = max(EF_SEARCH, count)
        scores, rows = graph.search(query[None].astype(np.float32), count)
        found = rows[0] >= 0  # faiss pads with -1 where it found fewer
        hits = best_documents(rows[0][found], scores[0][found], k)
        if len(hits) == k or count >= wanted:
            return hits
        count = min(wanted, count * 4)
