"""Training data through `datasets`: file kinds, formats and their loss masks, the split (by
chunk for a single corpus, or a separate eval set), bad rows by file:line, and the token cache."""

import dataclasses
import json

import pytest

from trainplan import config as C
from trainplan.errors import ConfigError
from trainplan.run import data, sources

IGNORE = data.IGNORE_INDEX

ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi there"},
            {"from": "gpt", "value": "Hello!"},
        ]
    },
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
]


@pytest.fixture(scope="module")
def chat_tok(tiny_run):
    """The embedded SmolLM2 tokenizer, which has a chat template."""
    import transformers

    root, _ = tiny_run
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "weights"))
    assert tok.chat_template
    return tok


@pytest.fixture(scope="module")
def plain_tok(tiny_run):
    """The same tokenizer without a chat template, as a base model's."""
    import transformers

    root, _ = tiny_run
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "weights"))
    tok.chat_template = None
    return tok


def write(path, rows):
    """`rows` as a .jsonl, .json (array), .parquet or .csv file, by the path's suffix."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import csv

        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return str(path)


def contents(docs):
    return [(d.text, d.prompt, d.completion, d.messages) for d in docs]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_file_kind_reads_the_same_documents(tmp_path, suffix):
    expected = data.load_documents(write(tmp_path / "ref.jsonl", ALPACA))
    docs = data.load_documents(write(tmp_path / f"a{suffix}", ALPACA), cache=str(tmp_path / "cache"))
    assert contents(docs) == contents(expected)
    assert docs[0].completion == "5" and "### Input:\n2 and 3" in docs[0].prompt
    assert docs[1].messages[0] == {"role": "user", "content": "Name a colour."}  # no input: the instruction alone
    line = {".jsonl": "a.jsonl:2", ".json": "a.json row 2", ".parquet": "a.parquet row 2", ".csv": "a.csv:3"}
    assert docs[1].name == line[suffix]


def test_format_is_detected_from_the_columns_and_can_be_forced(tmp_path):
    rows = {
        "text": [{"text": "plain words"}],
        "prompt-completion": [{"prompt": "Q?", "completion": "A."}],
        "alpaca": ALPACA[:1],
        "sharegpt": SHAREGPT[:1],
        "messages": [{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}],
    }
    for fmt, sample in rows.items():
        auto = data.load_documents(write(tmp_path / f"{fmt}.jsonl", sample))
        assert contents(auto) == contents(data.load_documents(str(tmp_path / f"{fmt}.jsonl"), fmt)), fmt
    sharegpt = data.load_documents(str(tmp_path / "sharegpt.jsonl"))[0]
    assert [m["role"] for m in sharegpt.messages] == ["system", "user", "assistant"]
    # one file may mix formats row by row; the column set is their union
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r[0]) + "\n" for r in rows.values()))
    docs = data.load_documents(str(mixed))
    assert [bool(d.text) for d in docs] == [True, False, False, False, False]
    assert docs[2].completion == "5" and docs[3].messages[1]["content"] == "Hi there"
    with pytest.raises(ConfigError, match=r'^data\.source: mixed\.jsonl:1: missing "instruction" \(alpaca\)'):
        data.load_documents(str(mixed), "alpaca")


def test_prompt_completion_and_alpaca_mask_the_prompt_exactly(plain_tok):
    tok = plain_tok
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, labels = data.tokenize(data.Document(name="x", prompt="Q: 2+2?", completion=" A: 4"), tok)
    assert ids == enc("Q: 2+2?") + enc(" A: 4")
    assert labels == [IGNORE] * len(enc("Q: 2+2?")) + enc(" A: 4")
    doc = sources._document("alpaca", ALPACA[0], "x:1", "data.source")
    prompt = enc(sources.ALPACA_INPUT.format(instruction="Add the numbers.", input="2 and 3"))
    ids, labels = data.tokenize(doc, tok)
    assert ids == prompt + enc("5") and labels == [IGNORE] * len(prompt) + enc("5")
    chat = data.Document(name="c", messages=({"role": "user", "content": "hi"},))
    with pytest.raises(ConfigError, match=r"^data\.format: c is a chat, but the model's tokenizer has no chat"):
        data.tokenize(chat, tok)


def test_chat_formats_learn_the_assistant_turns_only(chat_tok):
    tok = chat_tok
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    render = lambda m, gen=False: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    # ShareGPT: system / human / gpt become system / user / assistant
    doc = sources._document("sharegpt", SHAREGPT[0], "x:1", "data.source")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    messages.append({"role": "assistant", "content": "Hello!"})
    assert list(doc.messages) == messages
    prompt = render(messages[:2], gen=True)  # the assistant's header is prompt too
    reply = render(messages)[len(prompt) :]
    assert reply.startswith("Hello!")
    ids, labels = data.tokenize(doc, tok)
    assert ids == enc(prompt) + enc(reply)
    assert labels == [IGNORE] * len(enc(prompt)) + enc(reply)
    # Alpaca through the chat template: one user turn (instruction, input), one assistant turn
    ids, labels = data.tokenize(sources._document("alpaca", ALPACA[0], "x:1", "data.source"), tok)
    turns = [{"role": "user", "content": "Add the numbers.\n\n2 and 3"}, {"role": "assistant", "content": "5"}]
    prompt = render(turns[:1], gen=True)
    assert ids == enc(prompt) + enc(render(turns)[len(prompt) :])
    assert labels[: len(enc(prompt))] == [IGNORE] * len(enc(prompt))
    assert tok.decode([i for i in labels if i != IGNORE]).startswith("5<|im_end|>")


def test_a_single_text_corpus_is_split_by_chunks(tmp_path):
    corpus = tmp_path / "book.txt"
    text = "".join(f"Line {i} of the one long text, with words enough to fill it.\n" for i in range(800))
    corpus.write_text(text)
    train, held_out = data.load(C.DataConfig(source=str(corpus)))
    chunks = sorted(train + held_out, key=lambda d: int(d.name.split("#")[1]))
    assert "".join(d.text for d in chunks) == text and all(d.text.endswith("\n") for d in chunks)
    assert len(chunks) == len(text) // data.CHUNK_CHARS + 1 and len(held_out) == round(0.1 * len(chunks))
    assert not {d.name for d in train} & {d.name for d in held_out}
    assert data.load(C.DataConfig(source=str(corpus)))[1] == held_out  # stable
    with pytest.raises(ConfigError, match=r"^data\.format: alpaca needs rows with columns, but .*book\.txt"):
        data.load(C.DataConfig(source=str(corpus), format="alpaca"))
    short = tmp_path / "short.txt"
    short.write_text("one line of text, about a hundred characters long, which cannot be cut in two chunks.\n")
    with pytest.raises(ConfigError, match=r"^data\.source: 1 document\(s\).*data\.eval_source"):
        data.load(C.DataConfig(source=str(short)))


def test_a_separate_eval_source_holds_nothing_out_of_the_training_source(tmp_path):
    train_file = write(tmp_path / "train.jsonl", ALPACA)
    eval_file = write(tmp_path / "eval.parquet", SHAREGPT)
    train, held_out = data.load(C.DataConfig(source=train_file, eval_source=eval_file, eval_fraction=0))
    assert contents(train) == contents(data.load_documents(train_file))
    assert [d.name for d in held_out] == ["eval.parquet row 1", "eval.parquet row 2"]
    with pytest.raises(ConfigError, match=r"^data\.eval_fraction: is 0: .*data\.eval_source"):
        C.DataConfig(source=train_file, eval_fraction=0)
    with pytest.raises(ConfigError, match=r"^data\.eval_source: no such file or directory"):
        data.load(C.DataConfig(source=train_file, eval_source=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ConfigError, match=r"^data\.format: unknown value 'chatml'"):
        C.DataConfig(format="chatml")


@pytest.mark.parametrize(
    ("name", "body", "fmt", "message"),
    [
        (
            "train.jsonl",
            '{"instruction": "i", "output": "o"}\n\n{"instruction": "j"}\n',
            "alpaca",
            r'3: missing "output"',
        ),
        ("train.jsonl", '{"text": "a"}\n{"text": 5}\n', "auto", r'2: "text" must be a string \(got int\)'),
        ("train.jsonl", '{"text": "a"}\n\n{"text": \n', "auto", r"3: invalid JSON"),
        ("train.jsonl", '{"text": "a"}\n["a"]\n', "auto", r"2: is not a JSON object"),
        ("train.csv", "prompt,completion\np,c\nq,\n", "auto", r'3: missing "completion" \(prompt-completion\)'),
        ("train.jsonl", '{"conversations": [{"from": "bot", "value": "x"}]}\n', "auto", r"1: unknown speaker 'bot'"),
        ("train.jsonl", '{"txt": "a"}\n', "auto", r" has columns \['txt'\]"),
    ],
)
def test_a_bad_row_is_reported_by_file_and_line(tmp_path, name, body, fmt, message):
    (tmp_path / name).write_text(body)
    with pytest.raises(ConfigError, match=rf"^data\.source: {name}:?{message}") as e:
        data.load_documents(str(tmp_path / name), fmt, cache=str(tmp_path / "cache"))
    assert "\n" not in str(e.value)


def test_a_rerun_reads_the_token_cache_instead_of_tokenizing(tmp_path, monkeypatch, chat_tok, plain_tok):
    docs = data.load_documents(write(tmp_path / "a.jsonl", ALPACA + [{"prompt": "p", "completion": "c " * 300}]))
    calls = []
    real = data.tokenize
    monkeypatch.setattr(data, "tokenize", lambda doc, tok: calls.append(doc.name) or real(doc, tok))
    cache = str(tmp_path / "cache")
    first = data.pack(docs, chat_tok, 16, 49152, cache=cache)
    assert len(calls) == len(docs)
    again = data.pack(docs, chat_tok, 32, 49152, cache=cache)  # another seq_len: the same token cache
    assert len(calls) == len(docs)
    n = min(first[0].numel(), again[0].numel())
    assert again[0].flatten()[:n].tolist() == first[0].flatten()[:n].tolist()
    data.pack(docs, plain_tok, 16, 49152, cache=cache)  # another tokenizer: tokenized again
    assert len(calls) == 2 * len(docs)
    assert len(list((tmp_path / "cache").glob("tokens-*.arrow"))) == 2


def test_packing_puts_eos_after_each_document(plain_tok):
    docs = [data.Document(name="a", text="one two"), data.Document(name="b", prompt="Q", completion="A")]
    ids, labels, positions, *_ = data.pack(docs, plain_tok, 1, 49152)
    assert positions is None  # concat: the model's own positions, documents see those before them
    enc = lambda s: plain_tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = plain_tok.eos_token_id
    assert ids.flatten().tolist() == enc("one two") + [eos] + enc("Q") + enc("A") + [eos]
    assert labels.flatten().tolist() == enc("one two") + [eos] + [IGNORE] * len(enc("Q")) + enc("A") + [eos]


PACKED = [  # prompt/completion rows of several lengths: data.packing "auto" packs them as documents
    data.Document(name=f"r{i}", prompt=f"Question {i}: " + "why " * (i % 5), completion=f"Because {i}." + " so" * i)
    for i in range(9)
]


def _tiny_lm(attention: str):
    import torch
    import transformers

    from tests.conftest import TINY
    from trainplan.run import attention as A

    A.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, attn_implementation=attention, use_cache=False)  # as train builds it
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if attention == A.IMPLEMENTATION:
        A.install(model)
    return model


def _spans(positions) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document in the packed rows, padding included."""
    out = []
    for r, row in enumerate(positions.tolist()):
        starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
        out += [(r, a, b) for a, b in zip(starts, starts[1:], strict=False)]
    return out


def test_document_packing_fills_rows_with_whole_documents(plain_tok):
    assert data.packing_of(PACKED, "auto") == "document"
    assert data.packing_of([data.Document(name="t", text="x")], "auto") == "concat"
    packed = data.pack(PACKED, plain_tok, 48, 49152, packing="document")
    enc = lambda d: data.tokenize(d, plain_tok)  # noqa: E731
    eos = plain_tok.eos_token_id
    spans = _spans(packed.positions)
    real = [(r, a, b) for r, a, b in spans if packed.labels[r, a + 1 : b].ne(IGNORE).any()]
    assert len(real) == len(PACKED) and packed.truncated == 0  # each document whole, in order
    for doc, (r, a, b) in zip(PACKED, real, strict=True):
        ids, labels = enc(doc)
        assert packed.ids[r, a:b].tolist() == ids + [eos]
        assert packed.labels[r, a:b].tolist() == [IGNORE] + labels[1:] + [eos]  # the first predicted from nothing
    assert packed.filled == sum(b - a for _, a, b in real) < packed.ids.numel()
    cut = data.pack(PACKED, plain_tok, 8, 49152, packing="document")
    assert cut.truncated == sum(len(enc(d)[0]) + 1 > 8 for d in PACKED) > 0 and cut.ids.shape[1] == 8


@pytest.mark.parametrize("attention", ["trainplan_sdpa", "sdpa", "eager"])
def test_a_packed_documents_logits_ignore_the_other_documents_in_its_row(plain_tok, attention):
    """Block-causal attention from the position ids: changing one document's tokens changes its own
    logits and no other's in the row. Under concat packing (no position ids) the same change reaches
    the documents after it, so the check can fail."""
    import torch

    model = _tiny_lm(attention)
    packed = data.pack(PACKED, plain_tok, 64, 49152, packing="document")
    r, a, b = next(span for span in _spans(packed.positions) if span[1] > 0)  # a document after another
    row, pos = packed.ids[r : r + 1], packed.positions[r : r + 1]
    changed = row.clone()
    changed[0, :a] = (changed[0, :a] + 7) % 49152  # every document before it, other tokens
    with torch.no_grad():
        before, after = (model(input_ids=x, position_ids=pos).logits for x in (row, changed))
        assert torch.equal(before[0, a:b], after[0, a:b]) or torch.allclose(before[0, a:b], after[0, a:b], atol=1e-6)
        assert not torch.allclose(before[0, :a], after[0, :a], atol=1e-3)
        plain = [model(input_ids=x).logits for x in (row, changed)]
    assert not torch.allclose(plain[0][0, a:b], plain[1][0, a:b], atol=1e-3)


def test_packed_documents_attend_without_any_s_by_s_tensor_and_as_the_mask_does(plain_tok):
    """trainplan's document attention (run/attention.py, what train runs on packed documents): the logits
    and the gradients of the block-causal mask's SDPA, within fp32 rounding, and no tensor with two
    sequence-long dims at any moment of forward and backward, where transformers' masked path makes some."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Widest(TorchDispatchMode):
        square = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == t.shape[-2] == s:
                    self.square += 1
            return out

    packed = data.pack(PACKED, plain_tok, 48, 49152, packing="document")  # no other dim of the model is 48
    ids, pos, labels = packed.ids[:2], packed.positions[:2], packed.labels[:2]
    s = ids.shape[1]
    results = {}
    for attention in ("trainplan_sdpa", "sdpa"):
        model = _tiny_lm(attention).train()
        with Widest() as seen:
            out = model(input_ids=ids, position_ids=pos, labels=labels)
            out.loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results[attention] = (out.logits.detach(), grads, seen.square)
    (logits, grads, square), (ref_logits, ref_grads, ref_square) = results["trainplan_sdpa"], results["sdpa"]
    assert torch.allclose(logits, ref_logits, atol=1e-5) and torch.allclose(grads, ref_grads, atol=1e-6)
    assert square == 0 and ref_square > 0


def test_document_packed_losses_equal_each_document_run_alone(plain_tok):
    """fp32: the token losses of the packed rows, summed per document, are those of each document
    given to the model as a row of its own, within 1e-5."""
    import torch
    from torch.nn import functional as F

    model = _tiny_lm("sdpa")
    packed = data.pack(PACKED, plain_tok, 64, 49152, packing="document")
    with torch.no_grad():
        logits = model(input_ids=packed.ids, position_ids=packed.positions).logits
        token_loss = F.cross_entropy(
            logits[:, :-1].transpose(1, 2), packed.labels[:, 1:], ignore_index=IGNORE, reduction="none"
        )
        packed_sums = [float(token_loss[r, a : b - 1].sum()) for r, a, b in _spans(packed.positions)]
        packed_sums = [x for x in packed_sums if x]  # the padding's spans learn nothing
        alone = []
        for doc in PACKED:
            ids, labels = data.tokenize(doc, plain_tok)
            x = torch.tensor([ids + [plain_tok.eos_token_id]])
            y = torch.tensor([labels + [plain_tok.eos_token_id]])
            out = model(input_ids=x).logits
            alone.append(float(F.cross_entropy(out[0, :-1], y[0, 1:], ignore_index=IGNORE, reduction="sum")))
    assert packed_sums == pytest.approx(alone, rel=1e-5)


def test_a_dataset_in_the_local_hub_cache_is_read_by_id_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    repo = hub / "datasets--someone--tiny-chat"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit / "data"
    snapshot.mkdir(parents=True)
    write(snapshot / "train.jsonl", ALPACA)
    write(snapshot / "test.jsonl", ALPACA[:1])
    cache = str(tmp_path / "cache")
    docs = data.load_documents("someone/tiny-chat", cache=cache)
    assert contents(docs) == contents(data.load_documents(write(tmp_path / "a.jsonl", ALPACA)))
    assert docs[0].name == "someone/tiny-chat:train row 1"
    assert contents(data.load_documents("someone/tiny-chat:test", cache=cache)) == contents(docs[:1])
    with pytest.raises(ConfigError, match=r"^data\.source: 'someone/absent' is neither .*hf download someone/absent"):
        data.load_documents("someone/absent", cache=cache)


def test_training_runs_on_alpaca_with_a_sharegpt_eval_set(tiny_run, tmp_path):
    from trainplan.commands.train import execute

    _, base = tiny_run
    source = write(tmp_path / "train.parquet", ALPACA * 12)
    eval_source = write(tmp_path / "eval.jsonl", SHAREGPT * 4)
    cfg = C.load(
        None,
        [
            *base,
            f"data.source={source}",
            f"data.eval_source={eval_source}",
            "data.eval_fraction=0",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    # rows of 16 tokens hold the chat template's prompt and nothing of any reply: refused, not trained on NaN
    with pytest.raises(ConfigError, match=r"^batch\.seq_len: no token of the training split is learned at 16"):
        execute(dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, seq_len=16)), quiet=True)
    cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, seq_len=64))  # a whole chat per row
    record = execute(cfg, quiet=True)[0].to_json()
    assert record["data"]["train_documents"] == 24 and record["data"]["eval_documents"] == 8
    assert record["data"]["packing"] == "document" and record["data"]["truncated_documents"] == 0
    assert 0 < record["data"]["packing_efficiency"] < 1  # whole documents leave the rows' ends padded
    assert len(record["steps"]) == 3
    assert record["eval_after"]["loss"] < record["eval_before"]["loss"]


def test_a_rerun_on_the_same_data_and_tokenizer_reads_its_packed_splits_without_the_tokenizer(
    tiny_run, tmp_path, monkeypatch
):
    """Issue 47: the packed splits are cached by documents + tokenizer files + seq_len, so a rerun
    loads the tokenizer only after training (for the result's files), and trains on the same ids."""
    import torch

    from trainplan.commands.train import execute
    from trainplan.run import setup, weights

    root, base = tiny_run
    cache = tmp_path / "cache"

    def config(out: str, *extra: str) -> C.RunConfig:
        return C.load(None, [*base, f"model.cache_dir={cache}", "train.steps=2", f"train.output_dir={tmp_path / out}"])

    first = execute(config("a"), quiet=True)[0].to_json()
    packed = sorted(p.name for p in (cache / "datasets").glob("packed-*.safetensors"))
    assert len(packed) == 2  # the training and the held-out split
    calls = []
    real = weights.load_tokenizer
    monkeypatch.setattr(weights, "load_tokenizer", lambda *a: calls.append("load") or real(*a))
    prepared = setup.prepare(config("b"), setup.dist.init())
    try:
        assert calls == []  # built, packed and ready for step 1 without a tokenizer
        assert prepared.tokenizer is prepared.tokenizer and calls == ["load"]  # loaded once, when asked
    finally:
        for lock in prepared.locks:
            lock.release()
    second = execute(config("c"), quiet=True)[0].to_json()
    assert [s["loss"] for s in second["steps"]] == [s["loss"] for s in first["steps"]]
    # a cache file that is not sound is repacked, never trusted
    for f in (cache / "datasets").glob("packed-*.safetensors"):
        f.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    key = f.name[len("packed-") : -len(".safetensors")]
    assert data.cached_pack(str(cache / "datasets"), key, 32, 10**6) is None
    ids = torch.zeros(2, 32, dtype=torch.int64)
    data.store_pack(str(cache / "datasets"), key, data.Packed(ids, ids.clone(), None, 0, ids.numel()))
    assert data.cached_pack(str(cache / "datasets"), key, 32, 10**6) is not None
    assert data.cached_pack(str(cache / "datasets"), key, 16, 10**6) is None  # another seq_len
    assert data.cached_pack(str(cache / "datasets"), key, 32, 0) is None  # ids outside the vocabulary


def test_unpacked_rows_hold_one_document_and_a_batch_is_cut_to_its_longest(plain_tok):
    """data.packing = "none": a row per document, its length kept; a micro-batch is as wide as its
    longest row, and each document's token losses are those of the document run alone (the padding
    comes after it, where causal attention never looks)."""
    import torch
    from torch.nn import functional as F

    from trainplan.run.setup import Split

    packed = data.pack(PACKED, plain_tok, 64, 49152, packing="none")
    enc = [len(data.tokenize(d, plain_tok)[0]) + 1 for d in PACKED]
    assert packed.packing == "none" and packed.lengths.tolist() == enc and packed.ids.shape == (len(PACKED), 64)
    assert packed.filled == sum(enc) and packed.truncated == 0 and packed.positions is None
    split = Split(PACKED, *packed)
    rows = [0, 4, 8]
    batch = split.batch(rows, torch.device("cpu"))
    assert batch["input_ids"].shape == (3, max(enc[i] for i in rows)) and "position_ids" not in batch
    model = _tiny_lm("sdpa")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
        for k, i in enumerate(rows):
            n = enc[i]
            alone = model(input_ids=batch["input_ids"][k : k + 1, :n]).logits
            y = batch["labels"][k, 1:n]
            a = F.cross_entropy(logits[k, : n - 1], y, ignore_index=IGNORE, reduction="sum")
            b = F.cross_entropy(alone[0, :-1], y, ignore_index=IGNORE, reduction="sum")
            assert float(a) == pytest.approx(float(b), rel=1e-5)
            assert batch["labels"][k, n:].eq(IGNORE).all()  # the padding learns nothing
    cut = data.pack(PACKED, plain_tok, 12, 49152, packing="none")
    assert cut.truncated == sum(n > 12 for n in enc) > 0 and int(cut.lengths.max()) == 12


def test_grouping_by_length_orders_each_run_longest_first_and_is_a_state():
    lengths = [(i * 37) % 101 + 1 for i in range(200)]
    grouped = data.StatefulSampler(200, seed=3, lengths=lengths, group=40)
    plain = data.StatefulSampler(200, seed=3)
    order = grouped.take_global(200)
    assert sorted(order) == sorted(plain.take_global(200)) == list(range(200))  # every sample once
    for start in range(0, 200, 40):
        run = [lengths[i] for i in order[start : start + 40]]
        assert run == sorted(run, reverse=True)
    again = data.StatefulSampler(200, seed=3, lengths=lengths, group=40)
    assert again.take_global(200) == order  # deterministic by seed
    state = data.StatefulSampler(200, seed=3, lengths=lengths, group=40).state_dict()
    with pytest.raises(ConfigError, match=r"^data\.group_by_length: the checkpoint's sample order"):
        data.StatefulSampler(200, seed=3).load_state_dict(state)


def test_a_run_without_packing_records_its_shapes_and_learns(tiny_run, tmp_path):
    from trainplan.commands.train import execute

    _, base = tiny_run
    source = write(
        tmp_path / "train.jsonl", [{"prompt": "p " * (i % 7 + 1), "completion": "c " * (i % 5 + 1)} for i in range(40)]
    )
    settings = [*base, f"data.source={source}", "data.packing=none", "data.group_by_length=true"]
    cfg = C.load(None, [*settings, "data.max_length=40", f"train.output_dir={tmp_path / 'run'}"])
    record = execute(cfg, quiet=True)[0].to_json()
    assert record["data"]["packing"] == "none" and record["data"]["packing_efficiency"] < 1
    est = record["time_estimate"]  # the advisor's estimate for this config beside the measured steps
    assert est["measured_over_estimated"] == pytest.approx(est["measured_step_seconds"] / est["estimated_step_seconds"])
    assert est["estimated_train_seconds"] == pytest.approx(3 * est["estimated_step_seconds"])
    widths = [shape[1] for step in record["steps"] for shape in step["shapes"]]
    assert len(widths) == 3 and max(widths) <= 40 and len(set(widths)) >= 1
    assert record["eval_after"]["loss"] < record["eval_before"]["loss"]
    with pytest.raises(ConfigError, match=r"^train\.measure_step: is step 4, past the run's 3 steps"):
        C.load(None, [*base, "train.measure_step=4"])
    with pytest.raises(ConfigError, match=r'^data\.max_length: applies to data\.packing = "none"'):
        C.load(None, [*base, "data.max_length=40"])


def test_the_data_plan_finds_the_widest_micro_batch_and_a_run_measures_it(tiny_run, tmp_path, capsys):
    """A long tail: most rows are short, two are long. At batch.seq_len the fixed plan fits a budget the
    data's widest micro-batch does not: `plan --data` says DOES NOT FIT and names the step; the run's
    measured peak at that step is the data plan's within 5%."""
    from trainplan import cli
    from trainplan.commands.train import execute
    from trainplan.plan import analytic, from_data

    _, base = tiny_run
    rows = [{"prompt": f"q{i} ", "completion": "a " * 3} for i in range(38)]
    rows += [{"prompt": "long ", "completion": "word " * 150}] * 2
    source = write(tmp_path / "tail.jsonl", rows)
    settings = [
        *[s for s in base if not s.startswith("data.")],
        "data.packing=none",
        "data.max_length=256",
        "data.eval_fraction=0.1",
        "train.steps=18",
    ]
    cfg = C.load(None, [*settings, f"data.source={source}"])
    prof = from_data.profile(cfg)
    widest = prof["widest"]
    assert widest["shape"][1] > 150 and 1 <= widest["step"] <= 18 and prof["document_tokens"]["max"] > 150
    fixed, data_plan = analytic.plan(cfg).devices[0], from_data.plan(cfg).devices[0]
    assert data_plan.peak_allocated > fixed.peak_allocated
    budget = (fixed.total_bytes + fixed.margin_bytes + data_plan.total_bytes) // 2
    flags = [a for s in [*settings, f'hardware.memory_budget="{budget}B"'] for a in ("--set", s)]
    assert cli.main(["plan", *flags, "--set", f"data.source={source}", "--gpus", "cpu", "--json"]) == 0
    capsys.readouterr()
    assert cli.main(["plan", *flags, "--data", str(source), "--gpus", "cpu", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["fits"] is False and doc["data"]["widest"] == widest
    assert any(f"step {widest['step']} " in n for n in doc["notes"])
    run = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, output_dir=str(tmp_path / "run"), measure_step=widest["step"])
    )
    record = execute(run, quiet=True)[0].to_json()
    assert record["memory"]["step"] == widest["step"]
    assert record["steps"][widest["step"] - 1]["shapes"][0] == widest["shape"]
    measured = record["memory"]["per_rank"][0]["peak_bytes"]
    assert measured == pytest.approx(data_plan.peak_allocated, rel=0.05)


def test_unpacked_batches_peak_as_planned_at_each_steps_shape(tiny_run, tmp_path):
    """packing = "none" with bucketing on a skewed dataset: every step's micro-batch has its own width,
    and each of 30 steps' measured peak is the plan at that width within 5% (the first step, which
    creates the optimizer state, is the 31st run and not compared)."""
    from trainplan.commands.train import execute
    from trainplan.plan import analytic

    _, base = tiny_run
    rows = [{"prompt": f"q{i} " * (1 + i % 4), "completion": "word " * (2 + (i * 7) % 23)} for i in range(64)]
    rows += [{"prompt": "long ", "completion": "word " * (60 + 10 * i)} for i in range(4)]
    source = write(tmp_path / "skew.jsonl", rows)
    settings = [
        *[s for s in base if not s.startswith(("data.", "train.steps"))],
        f"data.source={source}",
        "data.packing=none",
        "data.group_by_length=true",
        "data.max_length=128",
        "batch.seq_len=128",
        "train.steps=31",
        "train.eval_batches=1",
        "train.measure_every_step=true",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    record = execute(C.load(None, settings), quiet=True)[0].to_json()
    assert 0 < record["data"]["packing_efficiency"] < 1
    planned: dict[int, int] = {}
    ratios = []
    for entry in record["steps"][1:]:
        (rows_, width), *_ = entry["shapes"]
        if width not in planned:
            cfg = C.load(None, [*settings[:-1], f"batch.seq_len={width}", "data.max_length=0"])
            planned[width] = analytic.plan(cfg).devices[0].peak_allocated
        ratios.append(entry["measured_peak_bytes"][0] / planned[width])
    assert len(ratios) == 30 and len(planned) >= 4  # the widths do vary
    assert all(0.95 <= x <= 1.05 for x in ratios), [f"{x:.3f}" for x in ratios]


def test_the_largest_batch_probe_runs_after_step_one_and_changes_nothing(tiny_run, tmp_path):
    """train.largest_batch_first: the longest rows' forward and backward, measured after step 1, and the
    run ends with the weights, bitwise, of the same run without it."""
    from trainplan.commands.train import execute

    _, base = tiny_run
    rows = [{"prompt": f"q{i} ", "completion": "word " * (2 + i % 9)} for i in range(30)]
    rows += [{"prompt": "long ", "completion": "word " * 90}]
    source = write(tmp_path / "probe.jsonl", rows)
    settings = [*[s for s in base if not s.startswith("data.")], f"data.source={source}", "data.packing=none"]
    settings += ["batch.seq_len=128", "train.measure_every_step=true", "data.eval_fraction=0.1"]
    runs = {}
    for probe in (False, True):
        cfg = C.load(
            None,
            [*settings, f"train.largest_batch_first={str(probe).lower()}", f"train.output_dir={tmp_path / str(probe)}"],
        )
        runs[probe] = execute(cfg, quiet=True)[0].to_json()
    probed, plain = runs[True], runs[False]
    assert "largest_batch_probe" not in plain and probed["final"] == plain["final"]
    probe = probed["largest_batch_probe"]
    assert probe["after_step"] == 1 and probe["shape"][1] > 90  # the long row is in it
    assert probe["shape"][1] >= max(shape[1] for s in probed["steps"] for shape in s["shapes"])
    assert probe["per_rank"][0] >= max(s["measured_peak_bytes"][0] for s in probed["steps"])


def test_accept_measures_the_widest_unpacked_step_and_checks_it_against_its_shapes_plan(tiny_run, tmp_path):
    """accept with one document a row: the run measures the step the data plan names as the widest,
    and the memory check plans that step's shape (not batch.seq_len): every row within tolerance."""
    from trainplan.plan import analytic, from_data
    from trainplan.run import loop
    from trainplan.verify import accept, checks

    _, base = tiny_run
    rows = [{"prompt": f"q{i} ", "completion": "word " * (2 + i % 11)} for i in range(40)]
    rows += [{"prompt": "long ", "completion": "word " * 100}]
    source = write(tmp_path / "accept.jsonl", rows)
    settings = [*[s for s in base if not s.startswith("data.")], f"data.source={source}", "data.packing=none"]
    cfg = C.load(None, [*settings, "batch.seq_len=256", "train.steps=12", f"train.output_dir={tmp_path / 'run'}"])
    measured = accept.widest_measured(cfg)
    widest = from_data.profile(cfg)["widest"]
    assert measured.train.measure_step == widest["step"] and widest["shape"][1] > 100
    record, _ = loop.run(measured)
    ledger = accept.memory_plan(C.from_dict(record.config), record)
    assert ledger.settings["seq_len"] == widest["shape"][1]
    check = checks.check_memory(record, ledger, accept.TOLERANCE)
    assert check.passed, check.summary
    at_seq = checks.check_memory(record, analytic.plan(C.from_dict(record.config)), accept.TOLERANCE)
    assert not at_seq.passed  # planned at batch.seq_len instead, the check would fail: it can tell
