"""A new scheduling policy is one class: shortest prompt first, against the default FCFS.

The policy only places arrivals in the waiting line; admission, batching
and preemption stay the scheduler's. With one sequence running at a time
the order requests start in is the line's order, and each request's tokens
stay what the model computes for it alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiny_model import solo_greedy, tiny_model_and_tokenizer

from kvtier.engine import Engine, SamplingParams
from kvtier.engine.request import Sequence as Seq

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


class ShortestPromptFirst:
    """Arrivals go before every waiting request with a longer prompt."""

    name = "shortest-prompt-first"

    def place(self, waiting: Sequence[Seq], seq: Seq) -> int:
        for i, other in enumerate(waiting):
            if len(other.prompt_ids) > len(seq.prompt_ids):
                return i
        return len(waiting)


def _start_order(
    engine: Engine, prompts: dict[str, list[int]]
) -> tuple[list[str], dict[str, list[int]]]:
    for rid, ids in prompts.items():
        engine.add_request(ids, GREEDY, request_id=rid)
    started: list[str] = []
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            if not tokens[out.request_id] and out.token_ids:
                started.append(out.request_id)
            tokens[out.request_id].extend(out.token_ids)
    return started, tokens


def test_shortest_prompt_first_reorders_the_line_and_changes_no_token() -> None:
    model, tok = tiny_model_and_tokenizer()
    prompts = {
        "long": list(range(5, 65)),
        "mid": [*range(65, 95)],
        "short": [*range(40, 50)],
    }
    fcfs = Engine(model, tok, num_blocks=64, block_size=4, max_num_seqs=1)
    spf = Engine(
        model, tok, num_blocks=64, block_size=4, max_num_seqs=1,
        scheduling_policy=ShortestPromptFirst(),
    )
    order_fcfs, tokens_fcfs = _start_order(fcfs, prompts)
    order_spf, tokens_spf = _start_order(spf, prompts)
    assert order_fcfs == ["long", "mid", "short"]
    assert order_spf == ["short", "mid", "long"]
    for rid, ids in prompts.items():
        assert tokens_fcfs[rid] == tokens_spf[rid] == solo_greedy(model, ids, 3)
    assert spf.queues.policy.name == "shortest-prompt-first"
    assert fcfs.queues.policy.name == "fcfs"
