"""A GGUF's tokenizer: converted by transformers once, then loaded from the cache, with the
same ids as transformers' own conversion (a tiny byte-level BPE written here; the real
default model in the `slow` test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from monokernel.errors import ModelNotFoundError
from monokernel.tokenizer import light
from monokernel.tokenizer import tokenizer as tokenizer_module
from monokernel.tokenizer.tokenizer import Tokenizer, gguf_tokenizer_entry

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = [
    "hi",
    "def reverse(s):\n    return s[::-1]\n",
    "  Hello,   world!\t tabs\nand\n\nnewlines ",
    "unicode: émoji 🤖 中文 — done",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "def f(): pass"},
        {"role": "user", "content": "again, with émoji 🤖"},
    ],
    [{"role": "user", "content": ""}],
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer_gguf(path: Path, name: str = "tiny") -> Path:
    """A GGUF holding a trained byte-level BPE (gpt2 style, as SmolLM2's) and a chat template:
    enough metadata for transformers' GGUF tokenizer conversion."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["def reverse(s):\n    return s[::-1]\n", "Hello world, hello tokenizer!"] * 20
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf")


def assert_same_ids(ours: Tokenizer, hf: object) -> None:
    """Our encode paths against plain transformers on the GGUF, for every text and chat."""
    for text in TEXTS:
        if text:
            assert ours.encode(text) == list(hf(text, add_special_tokens=True)["input_ids"]), text
    for chat in CHATS:
        rendered = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(chat) == list(hf(rendered, add_special_tokens=False)["input_ids"])
    ids = ours.encode(TEXTS[3])
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_first_load_converts_and_caches_then_the_cache_serves(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "tokenizers"
    entry = gguf_tokenizer_entry(tiny_gguf, cache)
    assert entry is not None and entry.parent == cache and not entry.exists()

    first = Tokenizer.load(tiny_gguf.parent, tiny_gguf.name, cache_dir=cache)
    assert (entry / "tokenizer.json").is_file() and (entry / "tokenizer_config.json").is_file()
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no temporary folder left

    second = Tokenizer.load(tiny_gguf.parent, tiny_gguf.name, cache_dir=cache, progress=True)
    assert Path(second.hf.name_or_path) == entry  # read from the cache, not the GGUF
    assert "building the tokenizer" not in capsys.readouterr().err

    hf = transformers.AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert_same_ids(first, hf)
    assert_same_ids(second, hf)
    assert second.has_chat_template and second.vocab_size == first.vocab_size


def test_key_follows_the_header_not_the_path(tiny_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(tiny_gguf.read_bytes())
    assert gguf_tokenizer_entry(copy, tmp_path) == gguf_tokenizer_entry(tiny_gguf, tmp_path)
    other = write_tokenizer_gguf(tmp_path / "other.gguf", name="other metadata")
    assert gguf_tokenizer_entry(other, tmp_path) != gguf_tokenizer_entry(tiny_gguf, tmp_path)


def test_key_follows_the_transformers_version(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = gguf_tokenizer_entry(tiny_gguf, tmp_path)
    monkeypatch.setattr(tokenizer_module, "_converter_version", lambda: "0.0.1")
    assert gguf_tokenizer_entry(tiny_gguf, tmp_path) != before


def test_a_damaged_entry_is_rebuilt(tiny_gguf: Path, tmp_path: Path) -> None:
    entry = gguf_tokenizer_entry(tiny_gguf, tmp_path)
    assert entry is not None
    entry.mkdir(parents=True)
    (entry / "tokenizer_config.json").write_text("{not json")
    tok = Tokenizer.load(tiny_gguf.parent, tiny_gguf.name, cache_dir=tmp_path)
    assert tok.encode("hello world") == tok.hf("hello world")["input_ids"]
    json.loads((entry / "tokenizer_config.json").read_text())  # replaced by a whole entry


def test_a_cache_that_is_a_file_only_costs_time(tiny_gguf: Path, tmp_path: Path) -> None:
    # An unwritable cache, in a form that holds for root too: nothing goes under a file.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    tok = Tokenizer.load(tiny_gguf.parent, tiny_gguf.name, cache_dir=blocker)
    assert tok.encode("hello")


def test_slow_conversion_is_announced(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(tokenizer_module, "slow_step", _immediate_slow_step)
    Tokenizer.load(tiny_gguf.parent, tiny_gguf.name, cache_dir=tmp_path, progress=True)
    assert "building the tokenizer from tiny.gguf (first run; cached afterwards)..." in (
        capsys.readouterr().err
    )


def _immediate_slow_step(note: str, enabled: bool = True) -> object:
    from monokernel.weights.progress import slow_step

    return slow_step(note, enabled, after_s=0.0)


def test_unreadable_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert gguf_tokenizer_entry(bad, tmp_path) is None
    with pytest.raises(ModelNotFoundError, match="could not load a tokenizer"):
        Tokenizer.load(tmp_path, "bad.gguf", cache_dir=tmp_path)


@pytest.mark.slow
def test_default_model_cached_tokenizer_equals_transformers(tmp_path: Path) -> None:
    from monokernel.weights.default_model import default_model_path

    try:
        path = default_model_path(progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"default model unavailable (offline?): {e}")
    first = Tokenizer.load(path.parent, path.name, cache_dir=tmp_path)
    cached = Tokenizer.load(path.parent, path.name, cache_dir=tmp_path)
    assert Path(cached.hf.name_or_path).parent == tmp_path
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert_same_ids(first, hf)
    assert_same_ids(cached, hf)


def test_a_probed_entry_serves_without_transformers(tiny_gguf: Path, tmp_path: Path) -> None:
    """The first load through transformers probes the light path (light.py) and marks the
    entry; later loads encode, render and decode through it, the same ids and text as
    transformers', and build transformers' tokenizer only when ``hf`` is asked for."""
    cache = tmp_path / "tokenizers"
    Tokenizer.load(tiny_gguf.parent, tiny_gguf.name, cache_dir=cache)
    entry = gguf_tokenizer_entry(tiny_gguf, cache)
    assert entry is not None and light.marked(entry)
    served = Tokenizer.load(tiny_gguf.parent, tiny_gguf.name, cache_dir=cache)
    assert isinstance(served._fast, light.LightTokenizer)
    hf = transformers.AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert_same_ids(served, hf)
    assert served.has_chat_template and served.vocab_size == len(hf)
    assert served._fast is not None  # all of that without transformers' tokenizer
    assert Path(served.hf.name_or_path) == entry and served._fast is None

    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from monokernel.tokenizer.tokenizer import Tokenizer\n"
        f"t = Tokenizer.load(Path({str(tiny_gguf.parent)!r}), {tiny_gguf.name!r}, "
        f"cache_dir=Path({str(cache)!r}))\n"
        "t.decode(t.encode_chat([{'role': 'user', 'content': 'hi'}]))\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_entry_the_light_path_disagrees_with_is_not_marked(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """A template feature only transformers has ({% generation %}) fails the probe: the
    entry stays transformers'. A marker from other library versions does not count."""
    hf = transformers.AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    hf.chat_template = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    entry = tmp_path / "entry"
    hf.save_pretrained(str(entry))
    assert not light.probe(hf, entry) and not light.marked(entry)
    assert light.probed(entry)  # the answer is kept: later starts do not probe again
    (entry / light.MARKER).write_text("transformers-0.0.1 tokenizers-0 jinja2-0 agrees\n")
    assert not light.marked(entry) and not light.probed(entry)
