"""A tiktoken-format BPE as a `tokenizers.Tokenizer` (k3cli/data/tiktoken_bpe.py): token for token what tiktoken
itself encodes, on ranks tiktoken's own trainer made, with a split pattern of Kimi Linear's form (character class
intersections, Han runs, case-aware words); the pattern read from a Python file without running it; bad files
refused with one error naming them."""
import base64
import json
import random

import pytest

from k3cli.data.tiktoken_bpe import (
    byte_chars,
    merges_of,
    pattern_of,
    read_ranks,
    read_tiktoken_folder,
    tokenizer_from_ranks,
)
from k3cli.errors import DataError

tiktoken = pytest.importorskip("tiktoken")

# a split pattern of the form Kimi Linear's tokenizer uses (its own is read from the model's folder)
PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
WORDS = ["the", "cat", "Hello", "WORLD", "它", "中文", "字符", "don't", "we're", "123456", "3.14", "😀", "naïve",
         "日本語", "\n\n", "  ", "\t", "ünïcödé", "混合text", "Q", "x"]


def corpus(n: int, seed: int) -> str:
    rng = random.Random(seed)
    alpha = "abcdefghijklmnoprstuABCDE中文字符日本語ü😀0123456789'.,!? \n"
    return "".join(rng.choice(alpha) for _ in range(n)) + " ".join(rng.choice(WORDS) for _ in range(n // 10))


def trained_ranks(vocab: int) -> dict[bytes, int]:
    from tiktoken._educational import bpe_train
    return bpe_train(corpus(20000, 0), vocab, PATTERN)


def write_tiktoken_folder(folder, ranks, specials) -> None:
    """The tokenizer files of a Kimi Linear folder, ours: tiktoken.model, tokenizer_config.json, and a Python
    file that assigns pat_str as a join of strings."""
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in specials.items()},
        "bos_token": specials[min(specials)], "eos_token": {"content": specials[min(specials) + 1]}}))
    parts = PATTERN.split("|")   # no alternative of PATTERN holds a | of its own
    (folder / "tokenization_test.py").write_text(
        "class T:\n    pat_str = '|'.join([\n" + "".join(f"        {p!r},\n" for p in parts) + "    ])\n")


@pytest.fixture(scope="module")
def ranks():
    return trained_ranks(330)


def test_encodes_as_tiktoken_and_decodes_back(ranks):
    n = len(ranks)
    specials = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>"}
    enc = tiktoken.Encoding("t", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={v: k for k, v in specials.items()})
    tok = tokenizer_from_ranks(ranks, PATTERN, specials)
    rng = random.Random(1)
    merged = 0
    for i in range(300):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        if i % 7 == 0:
            text = f"[BOS]{text}<|im_end|>"
        ids = tok.encode(text).ids
        assert ids == enc.encode(text, allowed_special="all"), repr(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        merged += sum(i >= 256 and i < n for i in ids)
    assert merged > 100   # the merges are exercised, not only single bytes
    assert [tok.token_to_id(t) for t in specials.values()] == list(specials)


def test_merges_rebuild_every_token_and_byte_chars_are_a_bijection(ranks):
    chars = byte_chars()
    assert len(set(chars)) == 256 and chars[ord("a")] == "a" and chars[ord(" ")] != " "
    merges = merges_of(ranks)
    assert len(merges) == sum(len(t) > 1 for t in ranks)
    assert all(a + b in ranks and ranks[a] < ranks[a + b] and ranks[b] < ranks[a + b] for a, b in merges)


def test_the_folder_reader_takes_the_pattern_without_running_the_file(ranks, tmp_path):
    n = len(ranks)
    write_tiktoken_folder(tmp_path, ranks, {n: "[BOS]", n + 1: "[EOS]"})
    (tmp_path / "tokenization_test.py").write_text(
        (tmp_path / "tokenization_test.py").read_text() + "raise SystemExit('this file must not run')\n")
    tok, bos, eos = read_tiktoken_folder(tmp_path)
    assert (bos, eos) == ("[BOS]", "[EOS]")
    assert pattern_of(tmp_path / "tokenization_test.py") == PATTERN
    (tmp_path / "plain.py").write_text(f"pat_str = {PATTERN!r}\n")
    assert pattern_of(tmp_path / "plain.py") == PATTERN


@pytest.mark.parametrize("content,match", [
    ("QUJD 1\nnot a line\n", r"tiktoken.model:2: not a `base64-token rank` line"),
    ("QUJD 1\n", "single bytes have no token"),
])
def test_bad_ranks_files_are_one_error_naming_the_file(tmp_path, content, match):
    (tmp_path / "tiktoken.model").write_text(content)
    with pytest.raises(DataError, match=match):
        read_ranks(tmp_path / "tiktoken.model")


def test_a_pattern_that_is_not_a_literal_is_refused(tmp_path):
    (tmp_path / "t.py").write_text("import os\npat_str = os.environ['X']\n")
    with pytest.raises(DataError, match="no `pat_str = <string>`"):
        pattern_of(tmp_path / "t.py")


def test_special_ids_must_follow_the_ranks(ranks):
    with pytest.raises(DataError, match="do not follow"):
        tokenizer_from_ranks(ranks, PATTERN, {len(ranks) + 5: "[BOS]"})
