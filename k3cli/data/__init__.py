"""Data: corpus → documents (`sources`) → byte-level BPE (`tokenizer`) → a prepared folder of memory-mapped
token shards (`shards`, written by `prepare`) → batches (`loader`). `prepare_data` is the entry point
training and evaluation call."""

from k3cli.data.loader import PackedLoader, check_token_ids, document_starts, pack_documents, val_batches
from k3cli.data.prepare import PreparedData, cache_root, prepare_data, prepare_shards
from k3cli.data.shards import MANIFEST, disk_bytes, is_prepared, open_prepared
from k3cli.data.sources import Document, iter_documents, load_documents, split_documents
from k3cli.data.tokenizer import EOT, EOT_ID, load_tokenizer, save_tokenizer, train_tokenizer
from k3cli.errors import DataError

__all__ = [
    "DataError", "Document", "EOT", "EOT_ID", "MANIFEST", "PackedLoader", "PreparedData", "cache_root",
    "check_token_ids", "disk_bytes", "document_starts", "is_prepared", "iter_documents", "load_documents",
    "load_tokenizer", "open_prepared", "pack_documents", "prepare_data", "prepare_shards", "save_tokenizer",
    "split_documents", "train_tokenizer", "val_batches",
]
