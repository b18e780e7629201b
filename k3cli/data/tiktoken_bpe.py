"""A tiktoken-format BPE (a `tiktoken.model` file of base64 tokens and their ranks, the split pattern, the
special tokens) as a `tokenizers.Tokenizer`, so that a model imported with such a tokenizer (Kimi Linear ships
one, and no tokenizer.json) reads and writes text through the same library as k3's own tokenizers.

tiktoken's BPE merges, at every step, the adjacent pair whose concatenation has the lowest rank; a byte-level
`tokenizers` BPE merges the pair listed first in its merges. The two agree when each token of two or more bytes
is listed as the pair it is built from, in rank order: that pair is what tiktoken's own BPE, run on the token's
bytes with the lower ranks only, ends with. Tokens no BPE run can build (none in practice) stay in the vocabulary
without a merge. Tokens are stored under the byte-to-character map of `tokenizers`' ByteLevel (printable
Latin-1 bytes stand for themselves, the other 68 bytes for the characters from U+0100 on, in byte order).
"""
from __future__ import annotations

import ast
import base64
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from k3cli.data.tokenizer import token_text
from k3cli.errors import DataError


def byte_chars() -> list[str]:
    """The character each byte 0..255 is written as inside a byte-level BPE vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in kept:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken.model file: one `base64(token) rank` per line."""
    ranks = {}
    try:
        lines = Path(path).read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError:
            raise DataError(f"{path}:{n}: not a `base64-token rank` line: {line[:80]!r}") from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(f"{path}: {len(missing)} single bytes have no token (byte {missing[0]} first): not a byte-level BPE")
    return ranks


def _last_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts tiktoken's BPE, allowed only ranks below the token's own, leaves of `token`; None when it
    leaves more than two."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], limit)
            if r < best:
                best, at = r, i
        if at < 0:
            return None
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def merges_of(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list in rank order: for each token of two or more bytes, the pair it is built from."""
    out = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            pair = _last_pair(token, ranks)
            if pair is not None:
                out.append(pair)
    return out


def tokenizer_from_ranks(ranks: dict[bytes, int], pattern: str, specials: dict[int, str]) -> Tokenizer:
    """The byte-level `tokenizers` BPE equal to tiktoken's Encoding(pattern, ranks, specials): ids are the
    ranks, and the special tokens (`id -> text`, matched whole before the split) keep their ids."""
    chars = byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    if len(set(vocab.values())) != len(vocab):
        raise DataError("the tiktoken ranks repeat an id")
    merges = [(text(a), text(b)) for a, b in merges_of(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    try:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    except Exception as e:  # the Rust regex error arrives as a bare Exception
        raise DataError(f"the tokenizer's split pattern does not compile: {str(e).splitlines()[0][:160]}") from None
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # added tokens take the next free ids in order, so they must follow the ranks without a gap
    first = max(vocab.values()) + 1
    want = list(range(first, first + len(specials)))
    if sorted(specials) != want:
        raise DataError(f"special token ids {sorted(specials)[:4]}... do not follow the {first} ranks without a gap")
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in want])
    return tok


def pattern_of(source: str | Path) -> str:
    """The split pattern a tiktoken tokenizer's Python file assigns to `pat_str`: a string, or a string's
    `.join` of a list of strings (read from the syntax tree; nothing is run)."""
    path = Path(source)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {getattr(t, "id", None) or getattr(t, "attr", None) for t in targets}
        if "pat_str" in names and node.value is not None:
            value = _literal_string(node.value)
            if value is not None:
                return value
    raise DataError(f"{path}: no `pat_str = <string>` (or `<string>.join([...])`) to take the split pattern from")


def _literal_string(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple))):
        items = [_literal_string(x) for x in node.args[0].elts]
        if all(isinstance(x, str) for x in items):
            return node.func.value.value.join(items)
    return None


def read_tiktoken_folder(folder: str | Path) -> tuple[Tokenizer, str | None, str | None]:
    """The tokenizer of a folder with `tiktoken.model`, `tokenizer_config.json` (its `added_tokens_decoder`,
    `bos_token`, `eos_token`) and the Python file that defines its `pat_str`: (tokenizer, bos text, eos text)."""
    folder = Path(folder)
    config = folder / "tokenizer_config.json"
    try:
        meta = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {config}: {e}") from None
    specials = {}
    for i, entry in (meta.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not str(i).isdigit():
            raise DataError(f"{config}: added_tokens_decoder entry {i!r} is not an id with a content")
        specials[int(i)] = content
    sources = sorted(p for p in folder.glob("*.py") if "pat_str" in p.read_text(encoding="utf-8", errors="replace"))
    if not sources:
        raise DataError(f"{folder}: no Python file defines the tokenizer's split pattern (pat_str)")
    tok = tokenizer_from_ranks(read_ranks(folder / "tiktoken.model"), pattern_of(sources[0]), specials)
    return tok, token_text(meta.get("bos_token")), token_text(meta.get("eos_token"))
