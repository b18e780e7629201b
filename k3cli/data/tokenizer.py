"""The byte-level BPE: `<|endoftext|>` is id 0, trained on a bounded sample of the train split, saved as
one tokenizer.json beside a run or a prepared folder."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k3cli.data.sources import Document, _unit_hash
from k3cli.errors import DataError
from k3cli.files import write_text_atomic

EOT = "<|endoftext|>"


EOT_ID = 0


# Whole-stdlib BPE training takes ~6 s on a 2-core CPU, an 8 MiB sample 1.7 s (vocab 4096); above
# this size train on a sample (first 8 MiB of train documents in hash order) to keep startup short.
TOKENIZER_FULL_MAX_BYTES = 20 * 2**20


TOKENIZER_SAMPLE_BYTES = 8 * 2**20


# BPE training merges within a word in time quadratic in its length (a 200 KB run of one letter took
# 14 s, a 20 MB one never finished), so longer runs of non-space characters reach the trainer in
# pieces of this size; the longest run in the stdlib's source is 1,170, so its tokenizer is unchanged
TOKENIZER_MAX_RUN = 2048


_FORMAT = 1  # bump when the meaning of cached files changes



def corpus_fingerprint(train: list[Document], val: list[Document], vocab_size: int,
                       min_frequency: int) -> str:
    """sha256 (24 hex) over document names, sizes, content hashes, split membership and BPE settings."""
    h = hashlib.sha256(json.dumps({
        "format": _FORMAT, "vocab_size": vocab_size, "min_frequency": min_frequency, "eot": EOT,
        "sample": [TOKENIZER_FULL_MAX_BYTES, TOKENIZER_SAMPLE_BYTES]}, sort_keys=True).encode())
    for split, docs in (("train", train), ("val", val)):
        for d in docs:
            digest = hashlib.sha1(d.text.encode("utf-8")).hexdigest()
            h.update(f"{split}\0{d.name}\0{d.nbytes}\0{digest}\n".encode())
    return h.hexdigest()[:24]


# beside tokenizer.json, as Hugging Face writes it: which tokens start a sequence and end one (bos_token,
# eos_token); k3's own tokenizers have none and use <|endoftext|> for both
SPECIALS = "tokenizer_config.json"


def _ready(tok: Tokenizer, bos: str = EOT, eos: str = EOT, where: str = "the tokenizer") -> Tokenizer:
    """`tok` with `bos_id` and `eos_id` set: the id every sequence starts with and the one generation stops
    at (EOT_ID for k3's own tokenizers)."""
    # a literal special token inside a document is text, not the separator; this flag is not
    # stored in tokenizer.json, so set it on every load
    tok.encode_special_tokens = True
    for attr, text in (("bos_id", bos), ("eos_id", eos)):
        i = tok.token_to_id(text)
        if i is None:
            raise DataError(f"{where} has no {text!r} token ({attr.split('_')[0]}): name its start and end tokens "
                            f"in {SPECIALS} (bos_token, eos_token)")
        setattr(tok, attr, i)
    return tok


def write_specials(folder: str | os.PathLike, bos: str, eos: str) -> None:
    """Record a tokenizer's start and end tokens beside its tokenizer.json (`SPECIALS`)."""
    write_text_atomic(Path(folder) / SPECIALS, json.dumps({"bos_token": bos, "eos_token": eos}, indent=1) + "\n")


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _specials(folder: Path) -> tuple[str, str]:
    """(bos, eos) texts from `folder`'s SPECIALS file, <|endoftext|> for what it does not name."""
    path = folder / SPECIALS
    if not path.is_file():
        return EOT, EOT
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path}: {e}") from None

    meta = meta if isinstance(meta, dict) else {}
    return token_text(meta.get("bos_token")) or EOT, token_text(meta.get("eos_token")) or EOT


def _tokenizer_sample(train: list[Document]) -> list[str]:
    if sum(d.nbytes for d in train) <= TOKENIZER_FULL_MAX_BYTES:
        return [d.text for d in train]
    out, total = [], 0
    for d in sorted(train, key=lambda d: _unit_hash(d.name)):
        if total >= TOKENIZER_SAMPLE_BYTES:
            break
        out.append(d.text)
        total += d.nbytes
    return out


def _bounded_runs(texts: list[str]) -> Iterator[str]:
    """The texts, with each run of more than TOKENIZER_MAX_RUN non-space characters cut out of its
    text and given as pieces of at most that length (a text without one is given whole)."""
    long_run = re.compile(rf"\S{{{TOKENIZER_MAX_RUN + 1},}}")
    for text in texts:
        pos = 0
        for m in long_run.finditer(text):
            yield text[pos:m.start()]
            yield from (m.group()[i:i + TOKENIZER_MAX_RUN] for i in range(0, len(m.group()), TOKENIZER_MAX_RUN))
            pos = m.end()
        yield text[pos:]


def train_tokenizer(train: list[Document], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE with `<|endoftext|>` = id 0 and at most `vocab_size` tokens, trained on the train
    documents (all of them up to 20 MiB, else the first 8 MiB in hash order).
    decode(encode(s)) == s for any string: no normalizer, no prefix space, byte-level decoder."""
    if vocab_size < 257:
        raise DataError(f"model.vocab_size is {vocab_size}; a byte-level tokenizer needs >= 257 "
                        f"(256 bytes + {EOT})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = list(_bounded_runs(_tokenizer_sample(train)))
    tok.train_from_iterator(texts, trainer, length=len(texts))
    assert tok.token_to_id(EOT) == EOT_ID
    return _ready(tok)


def save_tokenizer(tok: Tokenizer, run_dir: str | os.PathLike) -> Path:
    """Write `run_dir/tokenizer.json` (atomically), and its start and end tokens beside it (`SPECIALS`) where
    they are not <|endoftext|>; return its path."""
    path = Path(run_dir) / "tokenizer.json"
    write_text_atomic(path, tok.to_str())
    bos, eos = getattr(tok, "bos_id", EOT_ID), getattr(tok, "eos_id", EOT_ID)
    if (bos, eos) != (EOT_ID, EOT_ID) or tok.token_to_id(EOT) != EOT_ID:
        write_specials(run_dir, tok.id_to_token(bos), tok.id_to_token(eos))
    return path


def load_tokenizer(run_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a run directory (or a tokenizer .json file)."""
    path = Path(run_dir)
    path = path if path.suffix == ".json" or path.is_file() else path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"no tokenizer at {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        raise DataError(f"cannot read tokenizer {path}: {(str(e).strip().splitlines() or ['malformed'])[0][:160]}") from None
    return _ready(tok, *_specials(path.parent), where=str(path))



def tokenizer_sha256(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()

