"""A tiny random Llama model and a character-level tokenizer, built offline for tests.

:func:`tiny_model_and_tokenizer` returns a 2-layer Llama with random weights
(seeded, so greedy output is reproducible) and a fast tokenizer whose vocab
is a few special tokens plus every printable ASCII character, tab and
newline; its ChatML-like chat template ends with the assistant header.
:func:`tiny_engine` wraps them in an :class:`~kvtier.engine.Engine`;
:func:`solo_greedy` is the plain model's greedy output, the reference that
generation through kvtier must match.
"""

from __future__ import annotations

from typing import Any

SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Printable ASCII (space to ``~``), tab and newline: any ASCII text encodes.
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))


def tiny_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` with a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama_config(tok: Any, max_position_embeddings: int = 512) -> Any:
    """A 2-layer Llama config small enough to run in tests, over ``tok``'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
    )


def tiny_gemma3_config(tok: Any, layer_types: list[str], window: int) -> Any:
    """A Gemma 3 text config of ``layer_types`` (sliding windows of ``window``) over ``tok``."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        sliding_window=window,
        layer_types=layer_types,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )


def tiny_model_and_tokenizer(seed: int = 0) -> tuple[Any, Any]:
    """A 2-layer random Llama (``vocab_size`` = the tokenizer's) and its tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tok)).eval()
    return model, tok


def tiny_engine(**engine_kwargs: Any) -> Any:
    """An :class:`~kvtier.engine.Engine` over the tiny model (``model_id`` "tiny" by default)."""
    from kvtier.engine import Engine

    model, tok = tiny_model_and_tokenizer()
    engine_kwargs.setdefault("model_id", "tiny")
    return Engine(model, tok, **engine_kwargs)


def solo_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the plain model, full recomputation each step (no kvtier at all)."""
    import torch

    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
    return out


def seeded_prompt(seed: int, length: int) -> list[int]:
    """``length`` token ids drawn from a seeded generator (stable across runs)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 90, (length,), generator=g).tolist()


def greedy_ignoring_eos(max_tokens: int) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens."""
    from kvtier.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_all(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Every prompt added at once and stepped to the end; each one's generated tokens."""
    rids = [engine.add_request(p, greedy_ignoring_eos(n)) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
        steps += 1
        assert steps < 2000, "the engine made no progress"
    return [got[r] for r in rids]


class TinyFamily:
    """A tiny random-weight model of one family for engines, an untouched copy for references.

    ``hf_greedy`` is transformers' own greedy ``generate`` on the reference
    (its own caches and masks), memoized; ``engine`` serves ``model``, a
    deep copy, through kvtier. Neither stops at EOS: the engine runs with
    ``ignore_eos``.
    """

    def __init__(
        self, model_class: Any, config: Any, tokenizer: Any, model_id: str, block_size: int,
        num_blocks: int = 64,
    ) -> None:  # fmt: skip
        import copy

        import torch

        self.tok = tokenizer
        torch.manual_seed(0)
        self.reference = model_class(config).eval()
        self.reference.generation_config.eos_token_id = None
        self.model = copy.deepcopy(self.reference)
        self.model_id = model_id
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._refs: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def hf_greedy(self, prompt: list[int], n: int) -> list[int]:
        import torch

        key = (tuple(prompt), n)
        if key not in self._refs:
            with torch.no_grad():
                out = self.reference.generate(
                    torch.tensor([prompt]), max_new_tokens=n, do_sample=False
                )
            self._refs[key] = out[0, len(prompt) :].tolist()
            assert len(self._refs[key]) == n
        return self._refs[key]

    def engine(self, **kw: Any) -> Any:
        from kvtier.engine import Engine

        kw.setdefault("num_blocks", self.num_blocks)
        return Engine(
            self.model, self.tok, model_id=self.model_id, block_size=self.block_size, **kw
        )


def check_chunked_batches_and_preemption(family: TinyFamily, max_batched_tokens: int) -> None:
    """Chunked prompts sharing a prefix in one batch, then a pool small enough to preempt:
    every request gets the reference's greedy tokens."""
    chunked = family.engine(max_num_seqs=4, max_num_batched_tokens=max_batched_tokens)
    shared = seeded_prompt(5, 13)
    prompts = [
        seeded_prompt(6, 3),
        shared + seeded_prompt(7, 20),
        seeded_prompt(8, 31),
        shared + seeded_prompt(9, 6),
    ]
    assert run_all(chunked, prompts, 9) == [family.hf_greedy(p, 9) for p in prompts]
    tight = family.engine(num_blocks=14, max_num_seqs=3)
    prompts = [seeded_prompt(10, 19), seeded_prompt(11, 17), seeded_prompt(12, 21)]
    assert run_all(tight, prompts, 11) == [family.hf_greedy(p, 11) for p in prompts]
    assert tight.counters.preemptions > 0
    tight.manager.check()


def request_mixes() -> dict[str, Any]:
    """Hypothesis strategies for :func:`check_request_mix`'s arguments (``@given(**...)``)."""
    from hypothesis import strategies as st

    return {
        "lengths": st.lists(st.integers(1, 30), min_size=1, max_size=4),
        "shared": st.integers(0, 16),
        "num_blocks": st.integers(12, 40),
        "budget": st.integers(4, 24),
    }


def check_prefix_hit_and_host_tier(family: TinyFamily) -> None:
    """Prompts evicted to a host tier and loaded back, then one cached prefix continued two
    ways (the same prompt, and another tail after its first 25 tokens): the reference's
    greedy tokens every time, with 24 tokens (six blocks of 4) taken from the cache."""
    from kvtier.offload.host import HostStore
    from kvtier.offload.tier import Tier

    engine = family.engine(num_blocks=16, tiers=[Tier(HostStore(), 64)])
    prompts = [seeded_prompt(20 + i, 29) for i in range(4)]
    for _round in range(2):
        for prompt in prompts:
            assert run_all(engine, [prompt], 6) == [family.hf_greedy(prompt, 6)]
    assert engine.counters.loaded_prompt_tokens > 0  # evicted prefixes came back from host
    engine.close()
    again = family.engine()
    prompt = seeded_prompt(30, 27)
    run_all(again, [prompt], 4)
    for tail in (prompt, prompt[:25] + seeded_prompt(31, 5)):
        outs = list(again.generate(tail, greedy_ignoring_eos(4)))
        assert outs[-1].metrics.cached_tokens == 24
        assert [t for o in outs for t in o.token_ids] == family.hf_greedy(tail, 4)


def check_moved_request(family: TinyFamily, steps_before: int) -> None:
    """A request moved to another engine after ``steps_before`` steps (1: mid-prefill, 5:
    mid-decode) keeps the reference's greedy tokens; moved after its prefill, the
    destination computes none of its prompt."""
    from kvtier.engine.migrate import migrate

    prompt = seeded_prompt(33, 17)
    a = family.engine(max_num_batched_tokens=8)
    b = family.engine(num_blocks=40)
    a.add_request(prompt, greedy_ignoring_eos(12), "r")
    got: list[int] = []
    for _ in range(steps_before):
        got.extend(t for out in a.step() for t in out.token_ids)
    computed = b.counters.computed_prompt_tokens
    assert migrate(a, b, "r", new_id="moved") == "moved"
    while b.has_unfinished():
        got.extend(t for out in b.step() for t in out.token_ids)
    assert got == family.hf_greedy(prompt, 12)
    if steps_before >= 5:
        assert b.counters.computed_prompt_tokens == computed
    b.manager.check()


def check_saved_directory_serves(family: TinyFamily, path: Any, text: str) -> Any:
    """What ``kvtier serve --model DIR`` does with the family saved to ``path``: probe, load
    and serve ``text`` over HTTP, answering the reference's greedy tokens. Returns the probe."""
    from serving import serving

    from kvtier.engine import Engine
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.model import probe_model

    family.reference.save_pretrained(path)
    family.tok.save_pretrained(path)
    info = probe_model(path)
    engine = Engine.from_config(EngineConfig(model=str(path)))
    with serving(engine, family.model_id) as srv:
        reply = srv.client().completions.create(
            model=family.model_id, prompt=text, max_tokens=5, temperature=0.0
        )
    prompt = family.tok.encode(text)
    want = family.tok.decode(family.hf_greedy(prompt, 5), skip_special_tokens=True)
    assert reply.choices[0].text == want
    return info


def check_request_mix(
    family: TinyFamily, lengths: list[int], shared: int, num_blocks: int, budget: int
) -> None:
    """Prompts sharing a prefix of ``shared`` tokens, chunked by ``budget`` tokens a step, in
    a pool of ``num_blocks`` (preempting where it must): the reference's greedy tokens, and
    every block back in the pool at the end."""
    prefix = seeded_prompt(40, shared)
    prompts = [prefix + seeded_prompt(41 + i, n) for i, n in enumerate(lengths)]
    n = 6
    if any(len(p) + n > (num_blocks - 2) * family.block_size for p in prompts):
        return  # every request must fit the pool alone
    engine = family.engine(num_blocks=num_blocks, max_num_seqs=3, max_num_batched_tokens=budget)
    assert run_all(engine, prompts, n) == [family.hf_greedy(p, n) for p in prompts]
    engine.manager.check()
    assert engine.manager.stats().used_blocks == 0
