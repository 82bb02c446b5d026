"""Tokenizers: raw bytes (vocab 256) and a byte-level BPE trained locally with `tokenizers`."""

import abc
import hashlib
import json
import pathlib
import typing
from collections.abc import Sequence

import numpy as np
from jaxtyping import Integer, UInt16


class AbstractTokenizer(metaclass=abc.ABCMeta):
    """A reversible map between text and `uint16` token ids.

    Every tokenizer here is lossless: `decode(encode(text)) == text` for any string.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """The number of token ids (ids lie in `[0, vocab_size)`)."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A short string that changes whenever the text-to-ids map changes (cache key)."""

    @abc.abstractmethod
    def encode(self, text: str) -> UInt16[np.ndarray, " n"]:
        """Token ids of `text`."""

    @abc.abstractmethod
    def decode(self, ids: Integer[np.ndarray, " n"] | Sequence[int]) -> str:
        """The text of `ids` (invalid UTF-8 is replaced by U+FFFD)."""

    @abc.abstractmethod
    def save(self, path: str | pathlib.Path) -> None:
        """Write the tokenizer to `path` (JSON); `load_tokenizer(path)` reads it back."""


@typing.final
class ByteTokenizer(AbstractTokenizer):
    """The UTF-8 bytes of the text as token ids: vocabulary 256, nothing to train or store.

    !!! Example

        ```python
        from s3req.train import ByteTokenizer
        tok = ByteTokenizer()
        ids = tok.encode("To be, or not to be")   # uint16 array of 19 byte values
        assert tok.decode(ids) == "To be, or not to be"
        ```
    """

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def fingerprint(self) -> str:
        return "byte"

    def encode(self, text: str) -> UInt16[np.ndarray, " n"]:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Integer[np.ndarray, " n"] | Sequence[int]) -> str:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError(
                "ByteTokenizer.decode: ids must lie in [0, 256); these come from another "
                "tokenizer."
            )
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps({"s3req_tokenizer": "byte"}))

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash("ByteTokenizer")


@typing.final
class BPETokenizer(AbstractTokenizer):
    """A byte-level BPE (GPT-2 style) held in a `tokenizers.Tokenizer`.

    Byte-level pre-tokenization and decoding make it lossless on any text. Build one with
    [`s3req.train.train_bpe`][] or read a saved one with [`s3req.train.load_tokenizer`][].

    **Arguments:**

    - `tokenizer`: a `tokenizers.Tokenizer` with a byte-level pre-tokenizer and decoder.
    """

    def __init__(self, tokenizer: typing.Any):
        self._tok = tokenizer
        self._json = tokenizer.to_str()

    @property
    def tokenizer(self) -> typing.Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def fingerprint(self) -> str:
        return "bpe-" + hashlib.sha256(self._json.encode()).hexdigest()[:16]

    def encode(self, text: str) -> UInt16[np.ndarray, " n"]:
        return np.asarray(self._tok.encode(text).ids, dtype=np.uint16)

    def decode(self, ids: Integer[np.ndarray, " n"] | Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(self._json)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def _import_tokenizers() -> typing.Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "The BPE tokenizer needs the `tokenizers` package: pip install 's3req[train]' "
            "(or use the byte tokenizer: --tokenizer byte)."
        ) from None
    return tokenizers


def train_bpe(text: str, vocab_size: int = 4096) -> BPETokenizer:
    """Train a byte-level BPE on `text` (a few seconds for the Shakespeare corpus).

    **Arguments:**

    - `text`: the training text (train split only, so validation stays unseen).
    - `vocab_size`: the target vocabulary, 257 to 65536 (ids are stored as `uint16`).

    **Returns:**

    A [`s3req.train.BPETokenizer`][].
    """
    if not 257 <= vocab_size <= 65536:
        raise ValueError(
            f"train_bpe: vocab_size must lie in [257, 65536] (uint16 ids over a 256-byte "
            f"alphabet), got {vocab_size}."
        )
    tk = _import_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    chunk = 1 << 16
    tok.train_from_iterator((text[i : i + chunk] for i in range(0, len(text), chunk)), trainer)
    return BPETokenizer(tok)


def load_tokenizer(path: str | pathlib.Path) -> AbstractTokenizer:
    """Read a tokenizer written by `AbstractTokenizer.save`.

    **Arguments:**

    - `path`: a JSON file: a `tokenizers` tokenizer, or the byte tokenizer's marker file.

    **Returns:**

    A [`s3req.train.ByteTokenizer`][] or [`s3req.train.BPETokenizer`][].
    """
    text = pathlib.Path(path).read_text()
    if json.loads(text).get("s3req_tokenizer") == "byte":
        return ByteTokenizer()
    tk = _import_tokenizers()
    return BPETokenizer(tk.Tokenizer.from_str(text))
