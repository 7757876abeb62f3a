"""Fine-tuning from ``model.init_from`` uses that model's tokenizer (issue 15, item 5).

In process, no launch: a tiny HF model and its tokenizer are written locally with ``transformers`` and
``tokenizers`` (no hub); the token ids are checked against ``transformers.AutoTokenizer``'s.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nodetrain.config.schema import Config, DataConfig, ModelConfig
from nodetrain.data import datasets as data
from nodetrain.data import reader
from nodetrain.data.checks import check_init_vocab, check_vocab, run_data_config

TEXT = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n" * 40


@functools.cache
def _tokenizer() -> Tokenizer:
    """A byte-level BPE of ~300 ids trained elsewhere (other text than the corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], initial_alphabet=alphabet)
    tok.train_from_iterator(["Rough winds do shake the darling buds of May, and so on"] * 20, trainer)
    return tok


NUM_IDS = _tokenizer().get_vocab_size()


def _model_dir(path: Path, rows: int, tokenizer: str | None = "json") -> Path:
    """A tiny Llama with ``rows`` embedding rows, and its tokenizer as tokenizer.json (``json``), as
    vocab.json + merges.txt only (``files``: what AutoTokenizer converts), or none."""
    config = transformers.LlamaConfig(
        vocab_size=rows, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok = _tokenizer()
    if tokenizer == "json":
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)
    elif tokenizer == "files":
        tok.model.save(str(path))
        spec = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "</s>", "add_prefix_space": False}
        (path / "tokenizer_config.json").write_text(json.dumps(spec))
    return path


def _cfg(tmp_path: Path, init_from: Path, tokenizer: str = "") -> Config:
    (tmp_path / "corpus.txt").write_text(TEXT)
    cfg = Config(
        data=DataConfig(source=str(tmp_path / "corpus.txt"), dir=str(tmp_path / "ds"), vocab_size=280)
    )
    cfg.data.tokenizer = tokenizer
    cfg.model = ModelConfig(name="tiny", init_from=str(init_from))
    return cfg


def _stream(directory: Path) -> list[int]:
    meta = json.loads((directory / "meta.json").read_text())
    parts = [np.fromfile(directory / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]
    return np.concatenate(parts).tolist()


@pytest.mark.parametrize("form", ["json", "files"])
def test_init_from_tokenizer_is_the_default(tmp_path: Path, form: str) -> None:
    model_dir = _model_dir(tmp_path / "hf", rows=NUM_IDS + 8, tokenizer=form)
    cfg = _cfg(tmp_path, model_dir)
    data_cfg = run_data_config(cfg)
    assert data_cfg.tokenizer == str(model_dir)
    directory = data.prepare(data_cfg)
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert _stream(directory) == reference.encode(TEXT, add_special_tokens=False)  # not a BPE of the corpus
    train = reader.TokenDataset.open(directory, "train")
    assert train.vocab_size == len(reference) and check_init_vocab(cfg.model, train) == NUM_IDS + 8


def test_a_padded_embedding_is_accepted_and_a_short_one_refused(tmp_path: Path) -> None:
    padded = _model_dir(tmp_path / "padded", rows=NUM_IDS + 20)  # e.g. Qwen pads its vocabulary
    cfg = _cfg(tmp_path, padded)
    train = reader.TokenDataset.open(data.prepare(run_data_config(cfg)), "train")
    assert check_init_vocab(cfg.model, train) == NUM_IDS + 20  # the model is built with the rows

    short = _model_dir(tmp_path / "short", rows=NUM_IDS - 20)
    cfg = _cfg(tmp_path, short)
    train = reader.TokenDataset.open(data.prepare(run_data_config(cfg)), "train")
    with pytest.raises(
        ValueError, match=rf"model\.init_from=.*embeds {NUM_IDS - 20} token ids .* has {NUM_IDS}: .*fix: "
    ):
        check_init_vocab(cfg.model, train)


def test_init_from_without_a_tokenizer_is_refused_unless_bpe_is_asked_for(tmp_path: Path, caplog) -> None:
    model_dir = _model_dir(tmp_path / "hf", rows=NUM_IDS, tokenizer=None)
    with pytest.raises(ValueError, match=r"model\.init_from=.* holds no tokenizer .*data\.tokenizer=bpe"):
        run_data_config(_cfg(tmp_path, model_dir))
    cfg = _cfg(tmp_path, model_dir, tokenizer="bpe")
    assert run_data_config(cfg) is cfg.data
    assert "a new BPE's ids do not mean" in caplog.text
    meta = json.loads((data.prepare(cfg.data) / "meta.json").read_text())
    assert meta["vocab_size"] == 280  # trained on the corpus, as asked
    other = _model_dir(tmp_path / "other", rows=NUM_IDS)
    given = _cfg(tmp_path, model_dir, tokenizer=str(other))  # an explicit directory wins
    assert run_data_config(given).tokenizer == str(other)


def _llama3_style_tokenizer(path: Path) -> Path:
    """A byte-level BPE whose post-processor puts ``<|begin_of_text|>`` before a text, as Llama-3's."""
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Rough winds do shake the darling buds of May"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
    )
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_stream_documents_start_with_the_tokenizer_s_bos(tmp_path: Path, add_bos) -> None:
    """data.add_bos for plain text (issue 10): null = what the tokenizer's post-processor does, so each
    document of a Llama-3-style tokenizer's stream is exactly ``tokenizer.encode(document)`` (BOS
    first); false leaves BOS out; the trained BPE (no post-processor BOS) gets none by default."""
    tok_dir = _llama3_style_tokenizer(tmp_path / "tok")
    docs = ["Shall I compare thee to a summer's day?", "Thou art more lovely and more temperate."]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs * 30))
    cfg = DataConfig(source=str(tmp_path / "c.jsonl"), dir=str(tmp_path / "d"), tokenizer=str(tok_dir))
    cfg.add_bos, cfg.val_fraction = add_bos, 0.5
    ds = reader.TokenDataset.open(data.prepare(cfg), "train")
    stream = np.asarray(ds.tokens).tolist()
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    eot = ref.convert_tokens_to_ids("<|end_of_text|>")
    with_bos = add_bos is not False
    expected = [ref.encode(d, add_special_tokens=with_bos) for d in docs]
    if with_bos:
        assert expected[0][0] == ref.convert_tokens_to_ids("<|begin_of_text|>")
    assert stream[: len(expected[0]) + 1 + len(expected[1])] == [*expected[0], eot, *expected[1]]

    plain = DataConfig(source=str(tmp_path / "c.jsonl"), dir=str(tmp_path / "bpe"), vocab_size=300)
    plain.add_bos = None if add_bos is None else False
    bpe = reader.TokenDataset.open(data.prepare(plain), "train")
    assert json.loads((bpe.path.parent / "meta.json").read_text())["bos_ids"] == []


def test_a_short_embedding_under_its_own_tokenizer_is_called_a_mismatched_checkpoint(tmp_path: Path) -> None:
    short = _model_dir(tmp_path / "short", rows=NUM_IDS - 20)
    cfg = _cfg(tmp_path, short)
    data_cfg = run_data_config(cfg)  # data.tokenizer empty: the tokenizer of model.init_from
    train = reader.TokenDataset.open(data.prepare(data_cfg), "train")
    with pytest.raises(
        ValueError, match=r"tokenizer in that same directory has .*mismatched checkpoint"
    ) as own:
        check_init_vocab(cfg.model, train, data_cfg.tokenizer)
    assert "leave data.tokenizer empty" not in str(own.value)
    assert f"a model.init_from checkpoint whose embedding covers {NUM_IDS} ids" in str(own.value)
    with pytest.raises(ValueError, match=r"fix: use the model's own tokenizer"):  # another tokenizer
        check_init_vocab(cfg.model, train, str(tmp_path / "other"))

    small = ModelConfig(name="tiny", init_from=str(short))
    with pytest.raises(ValueError, match=r"the tokenizer of model\.init_from=.*fix: remove model\.hf") as own:
        check_vocab(NUM_IDS - 20, train, data_cfg.tokenizer, small.init_from)
    assert "model's own tokenizer" not in str(own.value)
    with pytest.raises(ValueError, match=r"or use the model's own tokenizer"):
        check_vocab(NUM_IDS - 20, train, str(tmp_path / "other"), small.init_from)
