"""Training data: sources, formats, tokenization (cached), packing, the held-out split, and a
stateful sampler.

Sources (`data.source`, and `data.eval_source` for a separate held-out set; run/sources.py reads them):
- "default": the Python documentation every CPython ships (`pydoc_data.topics`), one document
  per topic;
- a .txt file (one document), or a directory of .txt files (one document each);
- a .jsonl / .json (JSON lines or one array of objects) / .parquet / .csv file, or a directory of
  one kind of them, read by `datasets`: one document per row;
- "owner/name" (or "owner/name:split"; default split "train"): a dataset already in the local
  Hugging Face hub cache, read offline (fetch it with `hf download owner/name --repo-type dataset`).

Formats (`data.format`, "auto": the first whose columns a row has, in this order):
- messages: `messages`, a list of {"role", "content"}: a chat;
- sharegpt: `conversations`, a list of {"from": human | gpt | system, "value"}: a chat;
- alpaca: `instruction`, optional `input`, `output`: the prompt is built from instruction and input;
- prompt-completion: `prompt` and `completion`;
- text: `text`: loss on every token.
Loss is taken on the response only: the completion, the Alpaca output, the assistant turns of a
chat (its header such as "<|im_start|>assistant\\n" is prompt, its end-of-turn is learned). With a
tokenizer that has a chat template, prompt/completion and Alpaca rows are rendered through it as
one user and one assistant turn; without one, the prompt is the plain text (Alpaca's: the Stanford
Alpaca prompt) followed by the completion, and chats are refused.

Documents are split into train and held-out evaluation *before* packing, so no document crosses
the split; a document goes to eval by a hash of its name (file:line for rows), so the split is
stable under reordering. A source of fewer than 2 documents (one .txt corpus) is cut into chunks
of whole lines (`chunks`), each a document of the split. With `data.eval_source` nothing of
`data.source` is held out. Each split is packed into fixed-length sequences (EOS after each
document) and shuffled deterministically by seed, epoch by epoch.

Tokenization is cached with `datasets` (`Dataset.map` to an Arrow file) under
`<model.cache_dir>/datasets/` (default ~/.cache/trainplan/datasets), next to the converted default
model, together with the Arrow copies `datasets` makes of the source files. The file is named by
a fingerprint of the documents, the tokenizer (its vocabulary, merges, normalizer, chat template)
and this module's tokenization version, never the sequence length: a rerun with the same data and
tokenizer reads the token ids back instead of tokenizing again. Deleting the folder is safe.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import NamedTuple

import torch

from trainplan.errors import ConfigError
from trainplan.run import sources
from trainplan.run.sources import Document

IGNORE_INDEX = -100
GROUP_MEGABATCH = 50  # data.group_by_length sorts runs of this many micro-batches (transformers' mega-batches)
TOKENIZE_VERSION = 1  # bump when `tokenize` changes what it returns: cached token ids go stale
CHUNK_CHARS = 4000  # a single text corpus is split in chunks of about this many characters
MIN_CHUNKS = 10  # ... or in at least this many, for a short text (chunks of >= 200 characters)


def cache_dir(model_cache_dir: str) -> str:
    """Where `datasets` keeps its Arrow copies of the sources and the cached token ids."""
    return str(Path(model_cache_dir).expanduser() / "datasets")


def load(data_cfg, *, cache: str | None = None) -> tuple[list[Document], list[Document]]:
    """The training and held-out documents of a DataConfig: `eval_source` when given, else
    `eval_fraction` of `source` held out."""
    docs = load_documents(data_cfg.source, data_cfg.format, cache=cache)
    if data_cfg.eval_source:
        return docs, load_documents(data_cfg.eval_source, data_cfg.format, field="data.eval_source", cache=cache)
    return split_documents(docs, data_cfg.eval_fraction)


def load_documents(
    source: str, fmt: str = "auto", *, field: str = "data.source", cache: str | None = None
) -> list[Document]:
    docs = sources.non_empty(sources.read(source, fmt, field, cache))
    if not docs:
        raise ConfigError(field, f"{source!r} holds no non-empty document", "point it at real text")
    return docs


def split_documents(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """Split by document, stable under reordering: a document goes to eval by a hash of its name.
    Fewer than 2 documents (a single text corpus) are cut into chunks first."""
    if len(docs) < 2:
        docs = [c for d in docs for c in chunks(d)]
    if len(docs) < 2:
        raise ConfigError(
            "data.source",
            f"{len(docs)} document(s): a held-out split needs at least 2",
            "add documents, or give a separate evaluation set in data.eval_source",
        )

    def bucket(d: Document) -> float:
        return int(hashlib.sha256(d.name.encode()).hexdigest()[:8], 16) / 2**32

    ordered = sorted(docs, key=bucket)
    n_eval = max(1, round(eval_fraction * len(docs)))
    return ordered[n_eval:], ordered[:n_eval]


def chunks(doc: Document) -> list[Document]:
    """A text document cut into pieces of whole lines, about CHUNK_CHARS long (fewer, shorter
    ones for a short text), named `<name>#<i>`. A line longer than two chunks is cut mid-line.
    Rows of other formats are not cut."""
    if not doc.text:
        return [doc]
    text = doc.text
    size = max(200, min(CHUNK_CHARS, len(text) // MIN_CHUNKS))
    pieces, start = [], 0
    while start < len(text):
        end = start + size
        newline = text.find("\n", end - 1)
        if end >= len(text) or newline == -1 and len(text) - start < 2 * size:
            end = len(text)
        elif newline != -1 and newline + 1 - start <= 2 * size:
            end = newline + 1
        pieces.append(text[start:end])
        start = end
    return [Document(name=f"{doc.name}#{i}", text=p) for i, p in enumerate(pieces) if p.strip()]


def tokenize(doc: Document, tokenizer) -> tuple[list[int], list[int]]:
    """(input_ids, labels) with labels masked to IGNORE_INDEX where no loss is taken."""
    if doc.messages and getattr(tokenizer, "chat_template", None):
        return _chat(doc, tokenizer)
    if doc.completion or doc.prompt:
        p = tokenizer(doc.prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(doc.completion, add_special_tokens=False)["input_ids"]
        return p + c, [IGNORE_INDEX] * len(p) + c
    if doc.messages:
        raise ConfigError(
            "data.format",
            f"{doc.name} is a chat, but the model's tokenizer has no chat template",
            "use a model with a chat template, or write the data as prompt/completion or text",
        )
    ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
    return ids, list(ids)


def _chat(doc: Document, tokenizer) -> tuple[list[int], list[int]]:
    """Render the chat turn by turn; each turn's new text is learned if it is the assistant's
    reply (from after its header, e.g. "<|im_start|>assistant\\n", to its end of turn)."""
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""

    def add(text: str, learned: bool) -> None:
        nonlocal rendered
        if not text.startswith(rendered):
            raise ConfigError(
                "data.format",
                f"{doc.name}: the chat template does not render this conversation turn by turn, so the "
                "assistant's turns cannot be told apart",
                "use a model whose template renders each turn as a prefix of the next, or data.format=text",
            )
        new = tokenizer(text[len(rendered) :], add_special_tokens=False)["input_ids"]
        ids.extend(new)
        labels.extend(new if learned else [IGNORE_INDEX] * len(new))
        rendered = text

    messages = list(doc.messages)
    for i, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        if assistant and i:
            add(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True), False)
        add(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False), assistant)
    return ids, labels


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's identity: everything that decides the ids `tokenize` returns."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([getattr(tokenizer, "chat_template", None), str(tokenizer.all_special_tokens)]).encode())
    return h.hexdigest()[:16]


def tokenized(docs: list[Document], tokenizer, cache: str | None = None):
    """A `datasets.Dataset` of each document's `input_ids` and `labels`. With `cache`, the
    result is an Arrow file there named by documents + tokenizer + TOKENIZE_VERSION, read back on
    a rerun instead of tokenizing again."""
    import datasets

    key = hashlib.sha256(f"{fingerprint(docs)} {tokenizer_fingerprint(tokenizer)} {TOKENIZE_VERSION}".encode())
    key = key.hexdigest()[:32]

    def encode(batch: dict) -> dict:
        pairs = [tokenize(docs[i], tokenizer) for i in batch["index"]]
        return {"input_ids": [p[0] for p in pairs], "labels": [p[1] for p in pairs]}

    token_list = datasets.List(datasets.Value("int64"))
    where = {"keep_in_memory": True}
    if cache is not None:
        Path(cache).mkdir(parents=True, exist_ok=True)
        where = {"cache_file_name": str(Path(cache) / f"tokens-{key}.arrow"), "load_from_cache_file": True}
    with sources.quiet():
        return datasets.Dataset.from_dict({"index": list(range(len(docs)))}).map(
            encode,
            batched=True,
            remove_columns=["index"],
            features=datasets.Features({"input_ids": token_list, "labels": token_list}),
            new_fingerprint=key,
            **where,
        )


def packing_of(docs: list[Document], setting: str) -> str:
    """data.packing for these documents: "auto" is "document" for rows with a prompt, a completion or
    a chat (messages, sharegpt, alpaca, prompt-completion), "concat" for plain text; "none" is one
    document a row, padded to the longest of its micro-batch."""
    if setting != "auto":
        return setting
    return "document" if any(d.messages or d.prompt or d.completion for d in docs) else "concat"


def packing_name(positions, lengths) -> str:
    """Which packing made these rows: per-row lengths (one document a row), per-document positions, or neither."""
    return "none" if lengths is not None else "concat" if positions is None else "document"


class Packed(NamedTuple):
    ids: torch.Tensor  # (n, seq_len)
    labels: torch.Tensor  # (n, seq_len), IGNORE_INDEX where no loss is taken
    positions: torch.Tensor | None  # (n, seq_len) restarting at 0 per document (document packing)
    truncated: int  # documents cut to seq_len (document and none; concat cuts none, it splits)
    filled: int  # the rows' slots that hold a document's token, not padding
    lengths: torch.Tensor | None = None  # (n,) each row's real tokens (packing "none": one document a row)

    @property
    def packing(self) -> str:
        return packing_name(self.positions, self.lengths)


def pack(
    docs: list[Document],
    tokenizer,
    seq_len: int,
    vocab_size: int,
    *,
    packing: str = "concat",
    split: str = "the split",
    cache: str | None = None,
    table=None,
) -> Packed:
    """The documents (EOS after each) as (n, seq_len) rows of ids and labels.

    none: one document a row, cut to seq_len (counted) and padded after its end, which causal
    attention never reads; its length is kept, and a micro-batch is cut to its longest row.

    concat: back to back, cut every seq_len tokens; a document attends to those before it in its row.
    document: whole documents per row, first fit in order, the rest of a row padded; each document's
    position ids restart at 0, so transformers masks attention block-causally (a token sees only its
    own document; masking_utils.find_packed_sequence_indices), and the label of each document's
    first token is ignored (it would be predicted from the previous document). A document longer
    than seq_len is cut to it and counted. The padding is a document of its own with no labels."""
    import numpy as np

    table = tokenized(docs, tokenizer, cache) if table is None else table  # `tokenized`'s, when the caller has it
    eos = tokenizer.eos_token_id
    columns = []
    for name in ("input_ids", "labels"):
        tokens = table.data.column(name).combine_chunks()
        columns.append(tokens.flatten().to_numpy(zero_copy_only=False).astype(np.int64))
    lengths = table.data.column("input_ids").combine_chunks().value_lengths().to_numpy(zero_copy_only=False)
    ids, labels = columns
    if ids.size and ids.max() >= vocab_size:
        raise ConfigError(
            "model.tokenizer",
            f"token id {ids.max()} is outside the model's vocabulary of {vocab_size}",
            "use the tokenizer that belongs to the model",
        )
    if packing in ("document", "none"):
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
        return _pack_documents(ids, labels, lengths, seq_len, eos=eos, pad=pad, split=split, alone=packing == "none")
    if eos is not None:  # after each document: at the running end of its tokens
        ends = np.cumsum(lengths)
        ids, labels = np.insert(ids, ends, eos), np.insert(labels, ends, eos)
    n = ids.size // seq_len
    if n == 0:
        raise ConfigError(
            "batch.seq_len",
            f"{seq_len} is longer than {split} ({ids.size} tokens)",
            "lower batch.seq_len, add data, or change data.eval_fraction",
        )
    return Packed(
        torch.from_numpy(ids[: n * seq_len].copy()).view(n, seq_len),
        torch.from_numpy(labels[: n * seq_len].copy()).view(n, seq_len),
        None,
        0,
        n * seq_len,
    )


def _pack_documents(
    ids, labels, lengths, seq_len: int, *, eos: int | None, pad: int, split: str, alone: bool = False
) -> Packed:
    import numpy as np

    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    extra = 0 if eos is None else 1
    rows: list[list[tuple[int, int]]] = [[]]  # per row: (document, its length in the row)
    free, truncated, filled = seq_len, 0, 0
    for i, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        size = n + extra
        if size > seq_len:
            size, truncated = seq_len, truncated + 1
        if size > free or alone and rows[-1]:
            rows.append([])
            free = seq_len
        rows[-1].append((i, size))
        free -= size
        filled += size
    if not rows[-1]:
        rows.pop()
    if not rows:
        raise ConfigError("data.source", f"{split} holds no token", "give documents with text")
    shape = (len(rows), seq_len)
    out_ids = np.full(shape, pad, dtype=np.int64)
    out_labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    out_pos = np.empty(shape, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for i, size in row:
            body = min(size, int(lengths[i]))
            out_ids[r, at : at + body] = ids[starts[i] : starts[i] + body]
            out_labels[r, at : at + body] = labels[starts[i] : starts[i] + body]
            if size > body:  # room for its EOS, learned
                out_ids[r, at + body] = out_labels[r, at + body] = eos
            out_labels[r, at] = IGNORE_INDEX  # predicted from the document before it
            out_pos[r, at : at + size] = np.arange(size)
            at += size
        out_pos[r, at:] = np.arange(seq_len - at)  # the padding: a document of its own, no labels
    ids_t, labels_t, pos_t = (torch.from_numpy(a) for a in (out_ids, out_labels, out_pos))
    if alone:  # one document a row: no positions to restart, its length instead
        row_lengths = torch.tensor([size for row in rows for _, size in row], dtype=torch.int64)
        return Packed(ids_t, labels_t, None, truncated, filled, row_lengths)
    return Packed(ids_t, labels_t, pos_t, truncated, filled)


# ---- the packed splits, cached: a rerun on the same data and tokenizer loads no tokenizer ----------

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack")


def tokenizer_files_fingerprint(directory: Path) -> str:
    """The tokenizer's identity read from its files, without loading it: every file of its directory
    but the weights (tokenizer.json, its config and chat template, special tokens, vocab and merges)."""
    h = hashlib.sha256()
    for f in sorted(Path(directory).iterdir()):
        if f.is_file() and f.suffix not in WEIGHT_SUFFIXES and not f.name.startswith("."):
            h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def pack_key(docs: list[Document], tokenizer_dir: Path, seq_len: int, packing: str = "concat") -> str:
    """What decides a packed split: its documents, the tokenizer's files, the sequence length, the
    packing and how `tokenize` and `pack` work (TOKENIZE_VERSION)."""
    text = f"{fingerprint(docs)} {tokenizer_files_fingerprint(tokenizer_dir)} {seq_len} {TOKENIZE_VERSION}"
    if packing != "concat":  # concat's key is the one earlier runs wrote
        text += f" {packing}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_pack(cache: str, key: str, seq_len: int, vocab_size: int) -> Packed | None:
    """A packed split saved by `store_pack`, checked before it is trusted (a header that parses,
    int64 (n, seq_len) tensors, ids inside the vocabulary, positions in the row); None if absent or
    not sound (repacked)."""
    from safetensors import safe_open

    from trainplan.files import safetensors_header

    file = Path(cache) / f"packed-{key}.safetensors"
    if not file.is_file():
        return None
    try:
        safetensors_header(file)
        with safe_open(str(file), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 -- safe_open has no __iter__
            meta = f.metadata() or {}
        truncated = int(meta.get("truncated", "0"))
        filled = int(meta.get("filled", "-1"))
    except (OSError, ValueError, RuntimeError):
        return None
    ids, labels, positions, lengths = t.get("ids"), t.get("labels"), t.get("positions"), t.get("lengths")
    tensors = (ids, labels) if positions is None else (ids, labels, positions)
    if not all(isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.dim() == 2 for x in tensors):
        return None
    if any(x.shape != ids.shape for x in tensors) or ids.shape[1] != seq_len or ids.shape[0] == 0:
        return None
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or truncated < 0:
        return None
    if filled == -1 and positions is None:  # written before the count: concat fills every slot
        filled = ids.numel()
    if not 0 < filled <= ids.numel():
        return None
    if positions is not None and (int(positions.min()) < 0 or int(positions.max()) >= seq_len):
        return None
    if lengths is not None and not (
        isinstance(lengths, torch.Tensor)
        and lengths.dtype == torch.int64
        and lengths.shape == ids.shape[:1]
        and int(lengths.min()) > 0
        and int(lengths.max()) <= seq_len
        and int(lengths.sum()) == filled
    ):
        return None
    return Packed(ids, labels, positions, truncated, filled, lengths)


def store_pack(cache: str, key: str, packed: Packed) -> None:
    """Save a packed split for the next run (written whole or not at all)."""
    import os

    from safetensors.torch import save_file

    folder = Path(cache)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".packed-{key}.{os.getpid()}.tmp"
    tensors = {"ids": packed.ids.contiguous(), "labels": packed.labels.contiguous()}
    for name in ("positions", "lengths"):
        if getattr(packed, name) is not None:
            tensors[name] = getattr(packed, name).contiguous()
    save_file(tensors, str(tmp), metadata={"truncated": str(packed.truncated), "filled": str(packed.filled)})
    os.replace(tmp, folder / f"packed-{key}.safetensors")


def fingerprint(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(json.dumps([d.name, d.text, d.prompt, d.completion, list(d.messages)], sort_keys=True).encode())
    return h.hexdigest()[:16]


class StatefulSampler:
    """Deterministic shuffled order per epoch; its position is state, so a resumed run continues
    where it stopped instead of replaying or skipping batches. Data-parallel ranks take strided
    slices of one global permutation from one global position, the same on every rank.

    `skipped`: sample ids (rows of the packed training set) left out for the rest of the run, in
    every epoch: the ones a rollback skipped, or `exclude` given from the start. They are part of
    the state, and loading a state adds its ids to them instead of replacing them, so a rollback
    that restores an older checkpoint keeps leaving out what was skipped since."""

    def __init__(self, n: int, *, seed: int, rank: int = 0, world: int = 1, exclude=(), lengths=None, group: int = 0):
        self.n, self.seed, self.rank, self.world = n, seed, rank, world
        self.lengths = None if lengths is None else [int(x) for x in lengths]
        self.group = group
        self.epoch, self.position = 0, 0  # position: an index into the epoch's global order
        self.skipped: list[int] = []
        self._skipped: set[int] = set()
        self.skip(exclude)
        self._order = self._permutation()
        if not self._order:
            raise ConfigError(
                "batch",
                f"{n} training sequences cannot feed {world} data-parallel ranks",
                "add data or lower batch.seq_len",
            )

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        if self.lengths is not None and self.group:  # data.group_by_length, as transformers' LengthGroupedSampler:
            # each run of `group` shuffled samples sorted longest first, so a micro-batch holds similar lengths
            chunks = (order[i : i + self.group] for i in range(0, len(order), self.group))
            order = [i for c in chunks for i in sorted(c, key=lambda i: -self.lengths[i])]
        return order[: len(order) - len(order) % self.world]  # every rank gets the same count

    def skip(self, ids) -> list[int]:
        """Leave these sample ids out from now on; returns the ones not left out already."""
        new = [i for i in dict.fromkeys(ids) if i not in self._skipped]
        self.skipped += new
        self._skipped.update(new)
        return new

    def take_global(self, k: int) -> list[int]:
        """The next k samples of every rank, in global order (rank r's are [r::world])."""
        out, misses = [], 0
        while len(out) < k * self.world:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            if misses > 2 * self.n:  # two epochs and not one sample left to take
                raise ConfigError(
                    "guard.rollback_skip",
                    f"rollbacks have skipped every one of the {self.n} training sequences",
                    "add data, lower guard.rollback_skip, or find what makes the run unstable",
                )
            i = self._order[self.position]
            self.position += 1
            if i in self._skipped:
                misses += 1
            else:
                out.append(i)
                misses = 0
        return out

    def take(self, k: int) -> list[int]:
        """This rank's next k samples."""
        return self.take_global(k)[self.rank :: self.world]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position // self.world,  # per rank: what checkpoints before global_position held
            "global_position": self.position,
            "seed": self.seed,
            "n": self.n,
            "world": self.world,
            "skipped": list(self.skipped),
            "group": self.group if self.lengths is not None else 0,  # data.group_by_length's runs, 0: off
        }

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["seed"] != self.seed:
            raise ConfigError(
                "data",
                "the checkpoint's data does not match this run's (size or seed differs)",
                "resume with the same data and seed",
            )
        if state.get("group", 0) != (self.group if self.lengths is not None else 0):
            raise ConfigError(
                "data.group_by_length",
                "the checkpoint's sample order was grouped otherwise (group_by_length, micro-batch or ranks differ)",
                "resume with the checkpoint's data.group_by_length, micro-batch size and rank count",
            )
        self.epoch = state["epoch"]
        # one global position, so another world size continues at the same global index; older
        # states held the per-rank position of ranks striding the permutation
        self.position = state.get("global_position", state["position"] * state.get("world", self.world))
        self.skip(state.get("skipped", ()))  # added to, never replaced: skipped samples stay skipped
        self._order = self._permutation()


def steps_for_epochs(epochs: float, sequences: int, global_batch: int) -> int:
    """Optimizer steps for `epochs` passes over `sequences` packed training sequences."""
    return max(1, math.ceil(epochs * sequences / global_batch))
