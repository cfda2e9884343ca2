"""Training data: sources, tokenization, packing, a split by document, and a stateful sampler.

Sources:
- "default": the Python documentation every CPython ships (`pydoc_data.topics`), one document
  per topic;
- a .txt file (one document), or a directory of .txt files (one document each);
- .jsonl with `text`, with `prompt`/`completion` (loss on the completion only), or with chat
  `messages` (rendered with the tokenizer's chat template, loss on assistant turns only).

Documents are split into train and held-out evaluation *before* packing, so no document crosses
the split. Each split is packed into fixed-length sequences (EOS between documents) and
shuffled deterministically by seed, epoch by epoch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trainplan.errors import ConfigError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Document:
    name: str
    text: str = ""
    prompt: str = ""
    completion: str = ""
    messages: tuple = ()


def load_documents(source: str) -> list[Document]:
    if source == "default":
        import pydoc_data.topics as topics

        return [Document(name=k, text=v) for k, v in sorted(topics.topics.items())]
    path = Path(source)
    if path.is_dir():
        docs = [Document(name=p.name, text=p.read_text(errors="replace")) for p in sorted(path.glob("*.txt"))]
    elif path.suffix == ".jsonl" and path.is_file():
        try:
            docs = _read_jsonl(path)
        except UnicodeDecodeError as e:
            raise ConfigError(
                "data.source", f"{source!r} is not UTF-8 text (byte {e.start})", "give a UTF-8 JSONL file"
            ) from None
    elif path.is_file():
        if b"\x00" in path.read_bytes()[:65536]:
            raise ConfigError("data.source", f"{source!r} is binary, not text", "give a .txt or .jsonl file of text")
        docs = [Document(name=path.name, text=path.read_text(errors="replace"))]
    else:
        raise ConfigError(
            "data.source",
            f"no such file or directory {source!r}",
            'give a .txt file, a directory of .txt files, a .jsonl file, or "default"',
        )
    docs = [d for d in docs if d.text.strip() or d.completion.strip() or d.messages]
    if not docs:
        raise ConfigError("data.source", f"{source!r} holds no non-empty document", "point it at real text")
    return docs


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(
                "data.source", f"{where}: invalid JSON ({e.msg})", "each line must be one JSON object"
            ) from None
        if not isinstance(row, dict):
            raise ConfigError("data.source", f"{where} is not a JSON object", 'write {"text": ...} per line')
        if "messages" in row:
            docs.append(Document(name=f"{path.name}:{n}", messages=_messages(row["messages"], where)))
        elif "prompt" in row and "completion" in row:
            docs.append(Document(name=f"{path.name}:{n}", prompt=str(row["prompt"]), completion=str(row["completion"])))
        elif "text" in row:
            docs.append(Document(name=f"{path.name}:{n}", text=str(row["text"])))
        else:
            raise ConfigError(
                "data.source",
                f"{where} has keys {sorted(row)}",
                'each line needs "text", "prompt"+"completion", or "messages"',
            )
    return docs


def split_documents(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """Split by document, stable under reordering: a document goes to eval by a hash of its name."""
    if len(docs) < 2:
        raise ConfigError(
            "data.source",
            f"{len(docs)} document(s): a held-out split needs at least 2",
            "add documents (one .txt per document, or one JSONL row per document)",
        )

    def bucket(d: Document) -> float:
        return int(hashlib.sha256(d.name.encode()).hexdigest()[:8], 16) / 2**32

    ordered = sorted(docs, key=bucket)
    n_eval = max(1, round(eval_fraction * len(docs)))
    return ordered[n_eval:], ordered[:n_eval]


def tokenize(doc: Document, tokenizer) -> tuple[list[int], list[int]]:
    """(input_ids, labels) with labels masked to IGNORE_INDEX where no loss is taken."""
    if doc.messages:
        ids, labels = [], []
        for i in range(len(doc.messages)):
            prefix = tokenizer.apply_chat_template(list(doc.messages[: i + 1]), tokenize=True)
            prefix = list(prefix["input_ids"] if hasattr(prefix, "keys") else prefix)
            new = prefix[len(ids) :]
            ids += new
            assistant = doc.messages[i].get("role") == "assistant"
            labels += new if assistant else [IGNORE_INDEX] * len(new)
        return ids, labels
    if doc.completion or doc.prompt:
        p = tokenizer(doc.prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(doc.completion, add_special_tokens=False)["input_ids"]
        return p + c, [IGNORE_INDEX] * len(p) + c
    ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
    return ids, list(ids)


def _messages(value, where: str) -> tuple:
    """A chat: a list of {"role": str, "content": str}, as chat templates expect."""
    if (
        not isinstance(value, list)
        or not value
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    ):
        raise ConfigError(
            "data.source",
            f'{where}: messages must be a non-empty list of {{"role": ..., "content": ...}} objects',
            'write e.g. "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]',
        )
    return tuple(value)


def pack(
    docs: list[Document], tokenizer, seq_len: int, vocab_size: int, *, split: str = "the split"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents (EOS after each) and cut into (n, seq_len) ids and labels."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    labels: list[int] = []
    for doc in docs:
        doc_ids, doc_labels = tokenize(doc, tokenizer)
        ids += doc_ids + ([eos] if eos is not None else [])
        labels += doc_labels + ([eos] if eos is not None else [])
    if ids and max(ids) >= vocab_size:
        raise ConfigError(
            "model.tokenizer",
            f"token id {max(ids)} is outside the model's vocabulary of {vocab_size}",
            "use the tokenizer that belongs to the model",
        )
    n = len(ids) // seq_len
    if n == 0:
        raise ConfigError(
            "batch.seq_len",
            f"{seq_len} is longer than {split} ({len(ids)} tokens)",
            "lower batch.seq_len, add data, or change data.eval_fraction",
        )
    return (torch.tensor(ids[: n * seq_len]).view(n, seq_len), torch.tensor(labels[: n * seq_len]).view(n, seq_len))


def fingerprint(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(json.dumps([d.name, d.text, d.prompt, d.completion, list(d.messages)], sort_keys=True).encode())
    return h.hexdigest()[:16]


class StatefulSampler:
    """Deterministic shuffled order per epoch; its position is state, so a resumed run continues
    where it stopped instead of replaying or skipping batches. Data-parallel ranks take strided
    slices of the same permutation."""

    def __init__(self, n: int, *, seed: int, rank: int = 0, world: int = 1):
        self.n, self.seed, self.rank, self.world = n, seed, rank, world
        self.epoch, self.position = 0, 0
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
        usable = len(order) - len(order) % self.world  # every rank gets the same count
        return order[self.rank : usable : self.world]

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["seed"] != self.seed:
            raise ConfigError(
                "data",
                "the checkpoint's data does not match this run's (size or seed differs)",
                "resume with the same data and seed",
            )
        self.epoch, self.position = state["epoch"], state["position"]
        old_world = state.get("world", self.world)
        if old_world != self.world:  # ranks stride one global permutation: continue at the same global index
            consumed = state["position"] * old_world
            self.position = -(-consumed // self.world)  # round up: never replay a sample
        self._order = self._permutation()
