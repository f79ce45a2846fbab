"""Models served as their users hold them, and a model too large for the machine refused.

A directory of sharded safetensors (several ``model-0000x-of-0000y`` files
and their index), a GGUF file of a family other than Llama (Qwen2, written
with the ``gguf`` package, its tokenizer in its metadata), and a model run
in bfloat16 on the CPU are each served by a real ``kvtier serve`` process and
answer a chat with transformers' own greedy tokens. A model whose weights
and KV cache exceed the memory the machine has free is refused before any
weight is read, with one line saying what it needs, what there is, and
what to change; the sizes come from the model's own files (the index's
``total_size``, a GGUF tensor table, or the parameters its config builds).
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("uvicorn")

from cli_launch import kvtier_cli  # noqa: E402
from serve_proc import ServeProcess  # noqa: E402
from tiny_model import tiny_model_and_tokenizer  # noqa: E402

from kvtier.cli import main  # noqa: E402
from kvtier.conformance.cases import TIE_TOLERANCE  # noqa: E402
from kvtier.conformance.tiny import CHAT_TEMPLATE, char_tokenizer, tiny_config  # noqa: E402
from kvtier.engine.model import weight_size  # noqa: E402

#: What every chat asks, and how many tokens it asks for.
QUESTION = "What is a paged KV cache?"
N = 8


def _save_sharded(path: Path, dtype: Any = None) -> Any:
    """The tiny Llama saved to ``path`` in shards of at most 100 KB; the model."""
    model, tok = tiny_model_and_tokenizer()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size="100KB")
    tok.save_pretrained(path)
    return model


def _stop_ids(model: Any, tok: Any) -> list[int]:
    """The tokens a server stops at: the model's EOS and the chat template's end markers."""
    ids = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    eos = model.config.eos_token_id
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


def _chat_prompt(tok: Any) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    return list(tok.encode(text, add_special_tokens=False))


def _greedy(model: Any, tok: Any) -> list[int]:
    """transformers' greedy ``generate`` on the chat prompt, stopping where a server stops."""
    prompt = _chat_prompt(tok)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=_stop_ids(model, tok),
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        )
    return list(out[0, len(prompt) :].tolist())


def _served_chat(args: list[str]) -> dict[str, Any]:
    """One greedy chat answered by ``kvtier serve ARGS``: its JSON body."""
    with ServeProcess([*args, "--served-model-name", "tiny", "--num-blocks", "64"]) as srv:
        status, body = srv.request(
            "POST",
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": N,
                "temperature": 0,
            },
        )
    assert status == 200, body
    reply: dict[str, Any] = body
    return reply


def _assert_answers(reply: dict[str, Any], tok: Any, want: list[int]) -> None:
    """The server's answer is ``want``: the same text, as many tokens, the same ending."""
    stops = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    choice = reply["choices"][0]
    assert choice["message"]["content"] == tok.decode(want, skip_special_tokens=True)
    assert reply["usage"]["completion_tokens"] == len(want)
    assert choice["finish_reason"] == ("stop" if want and want[-1] in stops else "length")


# -- sharded safetensors ----------------------------------------------------------------


@pytest.mark.process
def test_a_sharded_safetensors_directory_serves_transformers_greedy_tokens(
    tmp_path: Path,
) -> None:
    _save_sharded(tmp_path)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want = _greedy(reference, tok)
    _assert_answers(_served_chat(["--model", str(tmp_path)]), tok, want)


def test_a_sharded_directorys_weights_are_sized_from_its_index(tmp_path: Path) -> None:
    model = _save_sharded(tmp_path)
    params = sum(p.numel() for p in model.parameters())
    size = weight_size(tmp_path, "float32")
    assert size is not None and size.parameters == params
    assert size.nbytes == 4 * params and "total_size" in size.source
    half = weight_size(tmp_path, "bfloat16")
    assert half is not None and half.nbytes == 2 * params


# -- GGUF of a non-Llama family -------------------------------------------------------


def _write_qwen2_gguf(path: Path) -> Any:
    """A tiny random Qwen2 and the character tokenizer written to a GGUF file as llama.cpp
    lays one out (tensor names, byte-level vocabulary, chat template); the model."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    tok = char_tokenizer()
    config = tiny_config("qwen2", len(tok), num_hidden_layers=2)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda item: item[1])]
    special = set(tok.all_special_tokens)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE, as Qwen2's own files are
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    # No merges (every token is one character): transformers derives them from scores.
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_unk_token_id(tok.unk_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        writer.add_tensor(f"{gguf_name}.{suffix}", tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.mark.process
def test_a_qwen2_gguf_file_serves_transformers_greedy_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen2.gguf"
    written = _write_qwen2_gguf(path)
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, **kwargs)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).eval()
    assert reference.config.model_type == "qwen2"
    for name, tensor in written.state_dict().items():  # the file holds the model written
        assert torch.equal(reference.state_dict()[name], tensor), name
    want = _greedy(reference, tok)
    _assert_answers(_served_chat(["--model", str(path)]), tok, want)


def test_loading_a_gguf_file_parses_it_once_and_loads_what_transformers_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = pytest.importorskip("gguf")
    from kvtier.engine.model import load_model

    path = tmp_path / "tiny-qwen2.gguf"
    written = _write_qwen2_gguf(path)
    parsed: list[str] = []
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class CountingReader(reader_class):  # type: ignore[misc,valid-type]
        def __init__(self, file: Any, mode: Any = "r") -> None:
            parsed.append(str(file))
            super().__init__(file, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    from transformers import modeling_gguf_pytorch_utils as loader_module

    decoded: list[bool] = []  # return_tensors of each call that reached transformers' loader
    real_load = loader_module.load_gguf_checkpoint

    def counting_load(file: Any, return_tensors: bool = False, **kw: Any) -> Any:
        decoded.append(return_tensors)
        return real_load(file, return_tensors, **kw)

    monkeypatch.setattr(loader_module, "load_gguf_checkpoint", counting_load)
    loaded = load_model(path)
    # The config, the tokenizer, the geometry probe and the weights: one parse for all,
    # and the metadata (every vocabulary entry decoded) once, however many ask for it.
    assert parsed == [str(path)]
    assert decoded == [False, True]
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is name_map
    assert loader_module.load_gguf_checkpoint is counting_load
    for name, tensor in written.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, **kwargs)
    assert len(parsed) > 1  # transformers alone parses it again, for the tokenizer
    text = "<|im_start|>user\nabc<|im_end|>"
    assert loaded.tokenizer(text)["input_ids"] == tok(text)["input_ids"]


def test_the_shared_reader_reads_every_field_and_tensor_as_gguf_does(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from kvtier.engine.gguf_meta import gguf_parsed_once

    path = tmp_path / "tiny-qwen2.gguf"
    _write_qwen2_gguf(path)
    reference = gguf.GGUFReader(path)
    with gguf_parsed_once():
        shared = gguf.GGUFReader(path)
        assert type(shared) is not type(reference)  # the plain-array reader, not gguf's
    assert list(shared.fields) == list(reference.fields)
    for name, field in reference.fields.items():
        got = shared.fields[name]
        assert (got.offset, got.data, got.types) == (field.offset, field.data, field.types), name
        assert len(got.parts) == len(field.parts), name
        for a, b in zip(got.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    assert [t.name for t in shared.tensors] == [t.name for t in reference.tensors]
    for got_t, want_t in zip(shared.tensors, reference.tensors, strict=True):
        assert got_t.tensor_type == want_t.tensor_type and list(got_t.shape) == list(want_t.shape)
        assert got_t.data.dtype == want_t.data.dtype
        assert np.array_equal(got_t.data, want_t.data), got_t.name
    assert gguf.GGUFReader(path).__class__ is type(reference)  # gguf's own again after the block


_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text())
_PARSED = st.recursive(
    _LEAF,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    | st.tuples(inner, inner),
    max_leaves=30,
)


@given(_PARSED)
def test_a_fresh_copy_equals_a_deep_copy_and_shares_no_container(value: Any) -> None:
    from kvtier.engine.gguf_meta import fresh_copy

    got = fresh_copy(value)
    assert got == copy.deepcopy(value)

    def containers(v: Any) -> list[int]:
        if isinstance(v, dict):
            return [id(v), *(i for x in v.values() for i in containers(x))]
        if isinstance(v, list):
            return [id(v), *(i for x in v for i in containers(x))]
        if isinstance(v, tuple):
            return [i for x in v for i in containers(x)]
        return []

    assert not set(containers(got)) & set(containers(value))


def test_a_gguf_files_config_is_decoded_once_per_process_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import modeling_gguf_pytorch_utils as loader_module

    from kvtier.engine.model import probe_model

    path = tmp_path / "tiny-qwen2.gguf"
    _write_qwen2_gguf(path)
    decoded: list[str] = []
    real_load = loader_module.load_gguf_checkpoint

    def counting_load(file: Any, return_tensors: bool = False, **kw: Any) -> Any:
        decoded.append(str(file))
        return real_load(file, return_tensors, **kw)

    monkeypatch.setattr(loader_module, "load_gguf_checkpoint", counting_load)
    first, again = probe_model(path), probe_model(path)
    assert len(decoded) == 1 and first == again
    _write_qwen2_gguf(path)  # rewritten: another modification time, read afresh
    path.touch()
    probe_model(path)
    assert len(decoded) == 2


def test_a_gguf_files_weights_are_sized_from_its_tensor_table(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen2.gguf"
    model = _write_qwen2_gguf(path)
    size = weight_size(path, "bfloat16")
    assert size is not None and size.parameters == sum(p.numel() for p in model.parameters())
    assert size.nbytes == 2 * size.parameters and path.name in size.source


# -- bfloat16 on a CPU -----------------------------------------------------------------


@pytest.mark.process
def test_bfloat16_on_the_cpu_serves_transformers_bfloat16_greedy_tokens(tmp_path: Path) -> None:
    _save_sharded(tmp_path, torch.bfloat16)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16
    ).eval()
    want = _greedy(reference, tok)
    reply = _served_chat(["--model", str(tmp_path), "--dtype", "bfloat16"])
    got = tok.encode(reply["choices"][0]["message"]["content"], add_special_tokens=False)
    if got == [t for t in want if t not in _stop_ids(reference, tok)]:
        _assert_answers(reply, tok, want)
        return
    # bfloat16 sums in another order may part where two logits tie to bfloat16's rounding:
    # the first token that differs must be such a tie, by the conformance cases' measure.
    where = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert where is not None, (got, want)
    ids = _chat_prompt(tok) + want[:where]
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([ids])).logits[0, -1].float()
    margin = float(logits[want[where]] - logits[got[where]])
    assert margin <= TIE_TOLERANCE * max(1.0, float(logits.abs().max())), (got, want, margin)


# -- too large to fit ------------------------------------------------------------------


def test_a_model_larger_than_free_memory_is_refused_before_its_weights_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sharded directory whose index says its shards hold a pebibyte: refused in a line."""
    _save_sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["metadata"]["total_size"] = 2**50
    index.write_text(json.dumps(data))
    for shard in tmp_path.glob("model-*-of-*.safetensors"):
        shard.unlink()  # never read: a load would fail on these, not on memory
    capsys.readouterr()
    args = ["serve", "--model", str(tmp_path), "--port", "0", "--num-blocks", "64"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvtier: error: {tmp_path.name} does not fit: its weights need ")
    assert "1,048,576.00 GiB" in err and "metadata.total_size" in err
    assert "available on this" in err
    for fix in ("--dtype bfloat16", "a smaller model", "vLLM, SGLang"):
        assert fix in err, fix
    assert "--kv-cache-memory below" not in err  # the weights alone do not fit


@pytest.mark.process
def test_a_config_too_large_for_memory_exits_1_without_a_traceback(tmp_path: Path) -> None:
    """A directory holding only a config of a huge model (no weights): the parameters its
    family builds on the meta device are counted, and ``kvtier serve`` exits in a line."""
    tok = char_tokenizer()
    config = tiny_config(
        "qwen2",
        len(tok),
        hidden_size=16384,
        intermediate_size=65536,
        num_hidden_layers=64,
        num_attention_heads=128,
        num_key_value_heads=8,
    )
    config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    res = subprocess.run(
        kvtier_cli("serve", "--model", str(tmp_path), "--port", "0", "--num-blocks", "4"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    [line] = res.stderr.strip().splitlines()[-1:]
    assert line.startswith(f"kvtier: error: {tmp_path.name} does not fit")
    assert "parameters in float32, from the parameters of" in line
    assert "config.json" in line and "--dtype bfloat16" in line


def test_a_kv_cache_larger_than_free_memory_is_refused_with_the_size_that_fits(
    tmp_path: Path,
) -> None:
    """Weights that fit beside a KV cache that does not: the message names a cache that fits."""
    from kvtier.engine.config import available_memory, check_memory
    from kvtier.errors import ConfigError

    _save_sharded(tmp_path)
    weights = weight_size(tmp_path, "float32")
    free = available_memory("cpu")
    assert weights is not None and free is not None
    have, _ = free
    with pytest.raises(ConfigError, match=r"does not fit: .* a --kv-cache-memory below ") as info:
        check_memory(weights, have + 2**30, "cpu", "tiny")
    assert "its KV cache " in str(info.value) and "available on this" in str(info.value)
