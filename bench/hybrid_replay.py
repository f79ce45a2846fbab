"""Prefix caching for a hybrid (attention + linear attention) model under a byte budget.

A hybrid model such as Qwen3-Next mixes full-attention layers, which keep
per-token K and V, with linear-attention layers, which keep one fixed-size
state per sequence (a short convolution state and a recurrent state). To
resume a prompt after a cached prefix of P tokens, an engine needs the
attention layers' KV for those P tokens *and* every linear layer's state
taken exactly at position P. The memory model is Qwen3-Next-80B-A3B at its
real sizes, read from transformers' ``Qwen3NextConfig()`` defaults: 12 of
its 48 layers are full attention (2 KV heads of 256, K and V, bf16), 36 are
linear attention (a bf16 conv state of ``conv_dim x linear_conv_kernel_dim``
and a float32 recurrent state of ``value heads x key dim x value dim``).

The script replays a Mooncake trace (512-token prefix-chained blocks; by
default the conversation trace of ``shared/traces``) through four ways of
caching, each over byte-accounted items that share one device byte budget:

* ``none``, no hybrid prefix caching: the attention KV of every prompt block
  is kept (and costs memory) but a linear layer cannot resume mid-sequence,
  so every prompt is recomputed from its first token. Its hit ratio is 0 by
  construction; its ``kv found`` column is the share of prompt blocks whose
  attention KV *was* cached as a prefix: what a model whose states cost
  nothing would have reused in that memory.
* ``every_block``, a state checkpoint in every block: a cached block costs
  its tokens' attention KV plus one full checkpoint (all linear layers), so
  any cached block-aligned prefix can be resumed.
* ``sparse``, checkpoints where reuse is likely (after Marconi, FAST'25): a
  block costs only its attention KV; a checkpoint is kept only at the end of
  each request's last full prompt block and at branch points (the end of the
  longest cached prefix a request found, when the request goes on past it,
  i.e. a prefix shared by two different requests). A request resumes at the
  deepest checkpoint at or before the end of its longest cached prefix.
* ``sparse_flop``, the same admission with Marconi's FLOP-aware eviction in
  place of LRU: among the ``--window`` least recently used items that can
  go alone, evict the lowest ``recency + alpha * FLOPs saved per byte``
  (both scaled to [0, 1] over those items). ``--alpha 0`` is ``sparse``.
  Marconi tunes alpha per workload; here it is fixed by ``--alpha``.

The first three evict by LRU. Rules common to all:

* only full prompt blocks are cached (the last, partial block never is);
  output tokens are ignored: the trace has no block ids for them;
* at least one prompt token is always computed (the first output token needs
  the last prompt token's logits), so a prompt whose every block is cached
  resumes one block earlier, as serving engines do;
* a request's blocks are pinned while it is served; blocks that do not fit
  once everything unpinned is evicted are not cached;
* after a request, its blocks are touched last block first (a checkpoint just
  before its block), so LRU evicts a chain from its tail and never leaves a
  block without its parent. Evicting a block anyway drops every cached
  descendant block and checkpoint with it (counted as ``cascade``): a
  checkpoint past a missing block cannot be resumed.

Ratios are totals over the trace: token hit ratio is reused prompt tokens over
prompt tokens; block hit ratio is reused blocks over full prompt blocks; FLOP
hit ratio is prefill FLOPs saved over prefill FLOPs, with 2 FLOPs per active
weight per token (the routed experts a token uses, the shared expert, every
projection) plus attention's 4 x heads x head dim per (query, key) pair: a
token late in a long prompt costs more than an early one, so a reused prefix
saves less than its share of the tokens. Memory per cached
token is the mean bytes in use (sampled after every request) over the mean
number of tokens whose attention KV is cached.

Run ``python bench/hybrid_replay.py --help``. Results go to
``bench/results/hybrid_replay.json``.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from _common import (
    CONVERSATION_TRACE,
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    write_json,
)

from kvtier.errors import ConfigError
from kvtier.replay.progress import ProgressBar, want_progress
from kvtier.replay.traces import Trace, load_trace

Strategy = Literal["none", "every_block", "sparse", "sparse_flop", "slots"]
STRATEGIES: tuple[Strategy, ...] = ("none", "every_block", "sparse", "sparse_flop", "slots")
STRATEGY_LABELS: dict[Strategy, str] = {
    "none": "no hybrid caching",
    "every_block": "checkpoint every block",
    "sparse": "checkpoint where reuse is likely",
    "sparse_flop": "same, FLOP-aware eviction",
    "slots": "kvtier: checkpoint slots",
}
#: kvtier serve's --window-kv-ratio auto for state checkpoints (AUTO_STATE_RATIO in
#: kvtier.engine.windows, which imports torch; this replay does not).
DEFAULT_SLOT_RATIO = 0.05
_SPARSE: tuple[Strategy, ...] = ("sparse", "sparse_flop")
DEFAULT_ALPHA = 1.0
DEFAULT_WINDOW = 64
DEFAULT_BUDGETS = "8GiB,32GiB,128GiB,512GiB,inf"
DEFAULT_OUT = REPO / "bench" / "results" / "hybrid_replay.json"

BF16_BYTES = 2
FP32_BYTES = 4
_GIB = 1024**3
_UNITS = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_BUDGET = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(kib|mib|gib|tib|b)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class HybridMemory:
    """Bytes a hybrid model's cache spends: per token of attention KV, per state checkpoint."""

    name: str
    attention_layers: int
    linear_layers: int
    #: K and V of every attention layer for one token.
    kv_bytes_per_token: int
    #: One linear layer's convolution state.
    conv_state_bytes: int
    #: One linear layer's recurrent state.
    recurrent_state_bytes: int
    #: Prefill FLOPs per token that do not grow with the context (projections,
    #: experts, linear-attention state updates).
    flops_per_token: float
    #: Attention FLOPs per (query, key) pair, summed over the attention layers.
    flops_per_pair: float

    @property
    def checkpoint_bytes(self) -> int:
        """Every linear layer's state at one position: what resuming there needs."""
        return self.linear_layers * (self.conv_state_bytes + self.recurrent_state_bytes)

    def block_kv_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def prefill_flops(self, tokens: int) -> float:
        """FLOPs to prefill the first ``tokens`` tokens: what resuming after them saves."""
        return self.flops_per_token * tokens + self.flops_per_pair * tokens * (tokens + 1) / 2


def qwen3_next_memory() -> HybridMemory:
    """Qwen3-Next-80B-A3B's cache sizes from transformers' ``Qwen3NextConfig()`` defaults."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig()
    types = list(cfg.layer_types or ())
    n_attn = types.count("full_attention")
    n_linear = types.count("linear_attention")
    if n_attn + n_linear != len(types):
        raise ConfigError(f"unexpected Qwen3-Next layer types {sorted(set(types))}")
    kv_per_token = n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * BF16_BYTES
    conv_dim = (
        2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
        + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    )
    conv = conv_dim * cfg.linear_conv_kernel_dim * BF16_BYTES
    recurrent = (
        cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    ) * FP32_BYTES
    flops_per_token, flops_per_pair = _qwen3_next_flops(cfg, n_attn, n_linear, conv_dim)
    return HybridMemory(
        "Qwen3-Next-80B-A3B",
        n_attn,
        n_linear,
        kv_per_token,
        conv,
        recurrent,
        flops_per_token,
        flops_per_pair,
    )


def _qwen3_next_flops(cfg: Any, n_attn: int, n_linear: int, conv_dim: int) -> tuple[float, float]:
    """Prefill FLOPs of Qwen3-Next: 2 per active weight per token, plus attention's pairs.

    Matrix weights only (norms, biases and the router's softmax are noise);
    attention has a gated output, so its query projection is twice as wide.
    """
    h = cfg.hidden_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    attn_weights = h * 2 * q_dim + 2 * h * kv_dim + q_dim * h
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    linear_weights = (
        h * (2 * key_dim + 2 * value_dim)
        + h * 2 * cfg.linear_num_value_heads
        + conv_dim * cfg.linear_conv_kernel_dim
        + value_dim * h
    )
    expert = 3 * h * cfg.moe_intermediate_size
    moe_weights = (
        cfg.num_experts_per_tok * expert
        + 3 * h * cfg.shared_expert_intermediate_size
        + h * cfg.num_experts
    )
    layers = n_attn + n_linear
    per_token = 2.0 * (n_attn * attn_weights + n_linear * linear_weights + layers * moe_weights)
    # The delta rule reads, updates and reads out a key x value state per head.
    per_token += (
        n_linear
        * 6.0
        * cfg.linear_num_value_heads
        * cfg.linear_key_head_dim
        * (cfg.linear_value_head_dim)
    )
    # Scores (q.k) and the weighted sum of values: 2 x head_dim FLOPs each per head.
    per_pair = n_attn * 4.0 * q_dim
    return per_token, per_pair


@dataclass(frozen=True, slots=True)
class Budget:
    """A device byte budget as given on the command line (``None`` bytes: unlimited)."""

    text: str
    bytes: int | None


def parse_budgets(text: str, block_kv_bytes: int) -> list[Budget]:
    """``8GiB,500MiB,1000b,inf``: sizes in KiB/MiB/GiB/TiB, or ``b`` attention-only blocks."""
    budgets: list[Budget] = []
    for raw in text.split(","):
        s = raw.strip()
        if not s:
            continue
        if s.lower() in ("inf", "infinite", "unlimited"):
            budgets.append(Budget("inf", None))
            continue
        m = _BUDGET.match(s)
        if not m:
            raise ConfigError(
                f"cannot parse budget {s!r}: use a size such as 8GiB, 512MiB or 1TiB, a "
                "number of attention-only blocks such as 1000b, or inf"
            )
        value = float(m.group(1))
        unit = m.group(2).lower()
        n = int(value * (block_kv_bytes if unit == "b" else _UNITS[unit]))
        if n <= 0:
            raise ConfigError(f"budget {s!r} must be positive")
        budgets.append(Budget(s, n))
    if not budgets:
        raise ConfigError("no budgets given: pass --budgets such as 8GiB,32GiB,inf")
    return budgets


def parse_strategies(text: str) -> list[Strategy]:
    out: list[Strategy] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        match = [s for s in STRATEGIES if s == name]
        if not match:
            raise ConfigError(f"unknown strategy {name!r}: choose from {', '.join(STRATEGIES)}")
        if match[0] not in out:
            out.append(match[0])
    if not out:
        raise ConfigError(f"no strategies given: choose from {', '.join(STRATEGIES)}")
    return out


@dataclass(slots=True)
class RunStats:
    """Counters of one replay: one strategy at one budget."""

    strategy: Strategy
    budget: str
    budget_bytes: int | None
    block_size: int
    requests: int = 0
    prompt_tokens: int = 0
    #: Full prompt blocks: what could be cached and reused.
    prompt_blocks: int = 0
    #: Blocks resumed from (their tokens are not recomputed).
    reused_blocks: int = 0
    #: Blocks whose attention KV was cached as a prefix (capped as a resume is).
    kv_found_blocks: int = 0
    stored_blocks: int = 0
    #: Prompt blocks left uncached: pinned blocks filled the budget.
    unstored_blocks: int = 0
    checkpoints_stored: int = 0
    block_evictions: int = 0
    checkpoint_evictions: int = 0
    #: Blocks and checkpoints dropped because an ancestor block was evicted.
    cascade_drops: int = 0
    peak_bytes: int = 0
    #: Prefill FLOPs of every prompt, and the part the reused prefixes saved.
    prompt_flops: float = 0.0
    saved_flops: float = 0.0
    #: Sums over requests of what was resident after each one (for means).
    sum_bytes: int = 0
    sum_blocks: int = 0
    sum_checkpoints: int = 0
    seconds: float = 0.0

    @property
    def reused_tokens(self) -> int:
        return self.reused_blocks * self.block_size

    @property
    def token_hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_ratio(self) -> float:
        return self.reused_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def kv_found_ratio(self) -> float:
        return self.kv_found_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def flop_hit_ratio(self) -> float:
        return self.saved_flops / self.prompt_flops if self.prompt_flops else 0.0

    @property
    def mean_bytes(self) -> float:
        return self.sum_bytes / self.requests if self.requests else 0.0

    @property
    def mean_blocks(self) -> float:
        return self.sum_blocks / self.requests if self.requests else 0.0

    @property
    def mean_checkpoints(self) -> float:
        return self.sum_checkpoints / self.requests if self.requests else 0.0

    @property
    def bytes_per_cached_token(self) -> float:
        tokens = self.mean_blocks * self.block_size
        return self.mean_bytes / tokens if tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in (
            "reused_tokens",
            "token_hit_ratio",
            "block_hit_ratio",
            "kv_found_ratio",
            "flop_hit_ratio",
            "mean_bytes",
            "mean_blocks",
            "mean_checkpoints",
            "bytes_per_cached_token",
        ):
            out[name] = getattr(self, name)
        return out


@dataclass(slots=True)
class Outcome:
    """What serving one request did."""

    kv_found: int
    reused: int
    stored: int
    checkpoints_added: int


@dataclass(slots=True)
class HybridPrefixCache:
    """A byte-budgeted LRU over attention-KV blocks and linear-state checkpoints.

    Item ids: block key ``k`` is ``2k``; the checkpoint taken after block
    ``k`` (every linear layer's state at the block's last token) is
    ``2k + 1``. Under ``every_block`` the checkpoint is part of the block item.

    ``sparse_flop`` evicts by Marconi's utility instead of plain LRU: among
    the ``window`` least recently used items that can go without orphaning
    anything (checkpoints, and blocks without cached children, with their
    own checkpoint if they have one), the one with the lowest
    ``recency + alpha * efficiency``, both scaled to [0, 1] over those
    candidates, where efficiency is the FLOPs a resume there saves
    (``resume_flops(depth in blocks)``) per byte freed; a block without a
    checkpoint saves nothing by itself. With ``alpha`` 0 this is LRU.
    """

    strategy: Strategy
    budget: int | None
    block_bytes: int
    checkpoint_bytes: int
    stats: RunStats
    used: int = 0
    blocks: int = 0
    checkpoints: int = 0
    _lru: OrderedDict[int, int] = field(default_factory=OrderedDict)
    _parent: dict[int, int] = field(default_factory=dict)
    _children: dict[int, set[int]] = field(default_factory=dict)
    _depth: dict[int, int] = field(default_factory=dict)
    _tick: dict[int, int] = field(default_factory=dict)
    _heap: list[tuple[int, int]] = field(default_factory=list)
    _clock: int = 0
    alpha: float = DEFAULT_ALPHA
    window: int = DEFAULT_WINDOW
    resume_flops: Callable[[int], float] = float

    @property
    def _block_cost(self) -> int:
        if self.strategy == "every_block":
            return self.block_bytes + self.checkpoint_bytes
        return self.block_bytes

    def serve(self, keys: Sequence[int], max_reuse: int) -> Outcome:
        """One request with full prompt block ``keys``; at most ``max_reuse`` blocks reused."""
        lru = self._lru
        pinned: set[int] = set()
        # The checkpoint resumed from is copied into the request's own state
        # slot, so it is touched but not pinned; new ones are pinned until done.
        touched: set[int] = set()
        found = 0
        for k in keys:
            if 2 * k not in lru:
                break
            found += 1
        usable = min(found, max_reuse)
        reused = 0
        if self.strategy == "every_block":
            reused = usable
        elif self.strategy in _SPARSE:
            for i in range(usable - 1, -1, -1):
                ck = 2 * keys[i] + 1
                if ck in lru:
                    reused = i + 1
                    touched.add(ck)
                    lru.move_to_end(ck)
                    if self.strategy == "sparse_flop":
                        self._stamp(ck)
                    break
        for i in range(found):
            item = 2 * keys[i]
            pinned.add(item)
            lru.move_to_end(item)

        cost = self._block_cost
        stored = found
        for i in range(found, len(keys)):
            if not self._make_room(cost, pinned):
                break
            k = keys[i]
            item = 2 * k
            lru[item] = cost
            self.used += cost
            self.blocks += 1
            if self.strategy == "every_block":
                self.checkpoints += 1
            parent = keys[i - 1] if i else -1
            self._parent[k] = parent
            self._depth[k] = i + 1
            if parent >= 0:
                self._children.setdefault(parent, set()).add(k)
            pinned.add(item)
            stored += 1

        added = 0
        if self.strategy in _SPARSE and stored:
            # The end of what this request cached, and the branch point where
            # it left the longest cached prefix it found.
            positions = [stored] if found in (0, stored) else [found, stored]
            for pos in positions:
                ck = 2 * keys[pos - 1] + 1
                if ck in lru:
                    touched.add(ck)
                    continue
                if not self._make_room(self.checkpoint_bytes, pinned):
                    continue
                lru[ck] = self.checkpoint_bytes
                self.used += self.checkpoint_bytes
                self.checkpoints += 1
                pinned.add(ck)
                touched.add(ck)
                added += 1

        # Last block first, each checkpoint just before its block: the chain's
        # head ends up most recent, so LRU takes chains from the tail.
        stamp = self._stamp if self.strategy == "sparse_flop" else None
        for i in range(stored - 1, -1, -1):
            ck = 2 * keys[i] + 1
            if ck in touched and ck in lru:
                lru.move_to_end(ck)
                if stamp is not None:
                    stamp(ck)
            lru.move_to_end(2 * keys[i])
            if stamp is not None:
                stamp(2 * keys[i])
        return Outcome(found, reused, stored, added)

    def _stamp(self, item: int) -> None:
        """Record a touch for FLOP-aware eviction: its clock and a heap entry."""
        self._clock += 1
        self._tick[item] = self._clock
        heapq.heappush(self._heap, (self._clock, item))

    def _make_room(self, need: int, pinned: set[int]) -> bool:
        if self.budget is None:
            return True
        if need > self.budget:
            return False
        lru = self._lru
        flop_aware = self.strategy == "sparse_flop"
        while self.used + need > self.budget:
            if flop_aware:
                if not self._evict_by_utility(pinned):
                    return False
                continue
            oldest = next(iter(lru))
            # Pinned items were all touched during this request, so they sit
            # behind every unpinned one: a pinned head means nothing is left.
            if oldest in pinned:
                return False
            self._evict(oldest, cascade=False)
        return True

    def _evict_by_utility(self, pinned: set[int]) -> bool:
        # The heap holds (touch clock, item) for every touch; an entry is
        # stale once the item is touched again or gone. Pinned items and
        # blocks with cached children are dropped from it: a pinned item is
        # stamped again when its request is done, and a block is pushed back
        # when its last child goes.
        lru = self._lru
        heap = self._heap
        tick = self._tick
        cands: list[int] = []
        ticks: list[int] = []
        seen: set[int] = set()
        while heap and len(cands) < self.window:
            t, item = heapq.heappop(heap)
            if tick.get(item) != t or item in pinned or item in seen:
                continue
            if not item & 1 and (item >> 1) in self._children:
                continue
            seen.add(item)
            cands.append(item)
            ticks.append(t)
        if not cands:
            return False
        ckpt = self.checkpoint_bytes
        effs: list[float] = []
        for item in cands:
            depth = self._depth[item >> 1]
            if item & 1:
                effs.append(self.resume_flops(depth) / ckpt)
            elif item + 1 in lru:
                effs.append(self.resume_flops(depth) / (ckpt + self.block_bytes))
            else:
                effs.append(0.0)
        lo, hi = min(effs), max(effs)
        span = hi - lo
        last = max(len(cands) - 1, 1)
        best = 0
        best_score = float("inf")
        for n, eff in enumerate(effs):
            score = n / last + (self.alpha * (eff - lo) / span if span > 0 else 0.0)
            if score < best_score:
                best, best_score = n, score
        victim = cands[best]
        for n, item in enumerate(cands):
            if n != best:
                heapq.heappush(heap, (ticks[n], item))
        if not victim & 1 and victim + 1 in lru:
            self._evict(victim + 1, cascade=False)
        self._evict(victim, cascade=False)
        return True

    def _evict(self, item: int, *, cascade: bool) -> None:
        self.used -= self._lru.pop(item)
        self._tick.pop(item, None)
        st = self.stats
        if item & 1:
            self.checkpoints -= 1
            if cascade:
                st.cascade_drops += 1
            else:
                st.checkpoint_evictions += 1
            return
        self.blocks -= 1
        if self.strategy == "every_block":
            self.checkpoints -= 1
        if cascade:
            st.cascade_drops += 1
        else:
            st.block_evictions += 1
        key = item >> 1
        if item + 1 in self._lru:
            self._evict(item + 1, cascade=True)
        parent = self._parent.pop(key)
        del self._depth[key]
        if parent >= 0:
            siblings = self._children[parent]
            siblings.discard(key)
            if not siblings:
                del self._children[parent]
                if self.strategy == "sparse_flop" and 2 * parent in self._tick:
                    heapq.heappush(self._heap, (self._tick[2 * parent], 2 * parent))
        for child in list(self._children.get(key, ())):
            self._evict(2 * child, cascade=True)
        self._children.pop(key, None)

    def check(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent."""
        lru = self._lru
        assert self.used == sum(lru.values())
        assert self.budget is None or self.used <= self.budget
        n_blocks = sum(1 for it in lru if not it & 1)
        n_ckpts = sum(1 for it in lru if it & 1)
        assert n_blocks == self.blocks == len(self._parent) == len(self._depth)
        if self.strategy == "every_block":
            assert n_ckpts == 0 and self.checkpoints == self.blocks
            assert self.used == n_blocks * (self.block_bytes + self.checkpoint_bytes)
        else:
            assert n_ckpts == self.checkpoints
            assert self.used == n_blocks * self.block_bytes + n_ckpts * self.checkpoint_bytes
        if self.strategy == "none":
            assert n_ckpts == 0
        if self.strategy == "sparse_flop":
            assert set(self._tick) == set(lru)
        for it in lru:
            if it & 1:
                assert it - 1 in lru, "a checkpoint without its block"
        for key, parent in self._parent.items():
            assert parent < 0 or 2 * parent in lru, "a cached block without its parent"
            assert parent < 0 or key in self._children[parent]


@dataclass(slots=True)
class SlotCache:
    """kvtier's engine: attention blocks in an LRU pool, checkpoints in a fixed set of slots.

    What ``kvtier serve`` does for a hybrid model (``kvtier.engine.windows``):
    the budget buys blocks at ``block_bytes + ratio x checkpoint_bytes`` each,
    and ``ratio`` slots per block hold checkpoints. Every block a request
    computes gets a slot; once the request has passed it, the slot goes first
    in line to be reclaimed, except at likely resume points: where the
    request resumed from a cached prefix (a branch point) and where its
    prompt ends, which go last. A request resumes at the deepest block of
    its cached prefix whose checkpoint is still kept. Blocks are evicted
    LRU, tails first, as in :class:`HybridPrefixCache`; a block's slot is
    freed with it (the engine puts it first in line to be reclaimed, which
    comes to the same once another block needs a slot).
    """

    budget: int | None
    block_bytes: int
    checkpoint_bytes: int
    ratio: float
    stats: RunStats
    #: False: every released slot is simply the most recently used (plain LRU slots).
    resume_points: bool = True
    num_blocks: int | None = None
    num_slots: int | None = None
    used: int = 0
    blocks: int = 0
    checkpoints: int = 0
    _lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    _parent: dict[int, int] = field(default_factory=dict)
    _children: dict[int, set[int]] = field(default_factory=dict)
    #: Block keys with a checkpoint slot, first to be reclaimed first.
    _slots: OrderedDict[int, None] = field(default_factory=OrderedDict)
    _valuable: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.budget is not None:
            per_block = self.block_bytes + self.ratio * self.checkpoint_bytes
            self.num_blocks = int(self.budget // per_block)
            self.num_slots = int(self.ratio * self.num_blocks)
            if self.num_slots < 1:
                # At least one slot (as the engine keeps the slots running requests
                # need), and the blocks that fit beside it.
                self.num_slots = 1
                self.num_blocks = max(0, (self.budget - self.checkpoint_bytes) // self.block_bytes)

    def serve(self, keys: Sequence[int], max_reuse: int) -> Outcome:
        lru = self._lru
        found = 0
        for k in keys:
            if k not in lru:
                break
            found += 1
        usable = min(found, max_reuse)
        reused = 0
        for i in range(usable, 0, -1):
            if keys[i - 1] in self._slots:
                reused = i
                break
        pinned = set(keys[:found])
        stored = found
        for i in range(found, len(keys)):
            if not self._make_room(pinned):
                break
            k = keys[i]
            lru[k] = None
            self.blocks += 1
            self.used += self.block_bytes
            parent = keys[i - 1] if i else -1
            self._parent[k] = parent
            if parent >= 0:
                self._children.setdefault(parent, set()).add(k)
            pinned.add(k)
            stored += 1
        # The checkpoint it resumes from is held (never reclaimed) while it computes.
        held = keys[reused - 1] if reused else None
        if held is not None:
            self._valuable.add(held)  # a branch point
        end = min(stored, max_reuse)  # where the same prompt resumes
        added = 0
        # The blocks it computes get slots in turn, each released once passed.
        for i in range(reused, stored):
            k = keys[i]
            if k not in self._slots:
                if not self._take_slot(held):
                    continue
                self._slots[k] = None
                self.checkpoints += 1
                self.used += self.checkpoint_bytes
                added += 1
            if i == end - 1:
                self._valuable.add(k)
            self._release(k)
        if reused and keys[reused - 1] in self._slots:
            self._release(keys[reused - 1])
        # Last block first: the chain's head ends up most recent (tails go first).
        for i in range(stored - 1, -1, -1):
            lru.move_to_end(keys[i])
        return Outcome(found, reused, stored, added)

    def _release(self, key: int) -> None:
        self._slots.move_to_end(key, last=key in self._valuable or not self.resume_points)

    def _take_slot(self, held: int | None) -> bool:
        if self.num_slots is None or self.checkpoints < self.num_slots:
            return True
        victim = next((k for k in self._slots if k != held), None)
        if victim is None:
            return False
        self._drop_slot(victim)
        self.stats.checkpoint_evictions += 1
        return True

    def _drop_slot(self, key: int) -> None:
        del self._slots[key]
        self._valuable.discard(key)
        self.checkpoints -= 1
        self.used -= self.checkpoint_bytes

    def _make_room(self, pinned: set[int]) -> bool:
        if self.num_blocks is None:
            return True
        while self.blocks >= self.num_blocks:
            oldest = next(iter(self._lru), None)
            if oldest is None or oldest in pinned:
                return False
            self._evict(oldest, cascade=False)
        return True

    def _evict(self, key: int, *, cascade: bool) -> None:
        del self._lru[key]
        self.blocks -= 1
        self.used -= self.block_bytes
        st = self.stats
        if cascade:
            st.cascade_drops += 1
        else:
            st.block_evictions += 1
        if key in self._slots:
            self._drop_slot(key)
        parent = self._parent.pop(key)
        if parent >= 0:
            siblings = self._children[parent]
            siblings.discard(key)
            if not siblings:
                del self._children[parent]
        for child in list(self._children.get(key, ())):
            self._evict(child, cascade=True)
        self._children.pop(key, None)

    def check(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent."""
        assert self.blocks == len(self._lru) == len(self._parent)
        assert self.checkpoints == len(self._slots)
        assert self.num_slots is None or self.checkpoints <= self.num_slots
        assert self.num_blocks is None or self.blocks <= self.num_blocks
        assert all(k in self._lru for k in self._slots), "a slot without its block"
        assert self._valuable <= set(self._slots), "a valuable mark without its slot"
        assert self.used == self.blocks * self.block_bytes + (
            self.checkpoints * self.checkpoint_bytes
        )
        for parent in self._parent.values():
            assert parent < 0 or parent in self._lru, "a cached block without its parent"


def replay(
    trace: Trace,
    memory: HybridMemory,
    strategy: Strategy,
    budget: Budget,
    *,
    alpha: float = DEFAULT_ALPHA,
    window: int = DEFAULT_WINDOW,
    tick: Callable[[int], None] | None = None,
    check_every: int = 0,
    slot_ratio: float = DEFAULT_SLOT_RATIO,
    resume_points: bool = True,
) -> RunStats:
    """Replay ``trace`` through one strategy at one budget.

    ``alpha`` and ``window`` tune ``sparse_flop``'s eviction; ``check_every``
    > 0 checks the cache's bookkeeping after every that many requests.
    """
    bs = trace.block_size
    stats = RunStats(strategy, budget.text, budget.bytes, bs)

    @functools.cache
    def resume_flops(depth: int) -> float:
        return memory.prefill_flops(depth * bs)

    cache: HybridPrefixCache | SlotCache
    if strategy == "slots":
        cache = SlotCache(
            budget.bytes,
            memory.block_kv_bytes(bs),
            memory.checkpoint_bytes,
            slot_ratio,
            stats,
            resume_points=resume_points,
        )
    else:
        cache = HybridPrefixCache(
            strategy,
            budget.bytes,
            memory.block_kv_bytes(bs),
            memory.checkpoint_bytes,
            stats,
            alpha=alpha,
            window=window,
            resume_flops=resume_flops,
        )
    t0 = time.perf_counter()
    for n, req in enumerate(trace.requests, 1):
        keys = req.full_keys(bs)
        # At least the last prompt token is computed.
        out = cache.serve(keys, (req.input_length - 1) // bs)
        stats.requests += 1
        stats.prompt_tokens += req.input_length
        stats.prompt_blocks += len(keys)
        stats.kv_found_blocks += min(out.kv_found, (req.input_length - 1) // bs)
        stats.reused_blocks += out.reused
        stats.prompt_flops += memory.prefill_flops(req.input_length)
        stats.saved_flops += memory.prefill_flops(out.reused * bs)
        stats.stored_blocks += out.stored - out.kv_found
        stats.unstored_blocks += len(keys) - out.stored
        stats.checkpoints_stored += out.checkpoints_added
        stats.sum_bytes += cache.used
        stats.sum_blocks += cache.blocks
        stats.sum_checkpoints += cache.checkpoints
        stats.peak_bytes = max(stats.peak_bytes, cache.used)
        if check_every and n % check_every == 0:
            cache.check()
        if tick is not None and n % 256 == 0:
            tick(256)
    if tick is not None:
        tick(stats.requests % 256)
    stats.seconds = time.perf_counter() - t0
    return stats


def run_all(
    trace: Trace,
    memory: HybridMemory,
    budgets: Sequence[Budget],
    strategies: Sequence[Strategy],
    *,
    alpha: float = DEFAULT_ALPHA,
    window: int = DEFAULT_WINDOW,
    progress: bool = False,
    slot_ratio: float = DEFAULT_SLOT_RATIO,
    resume_points: bool = True,
) -> list[RunStats]:
    """Every strategy at every budget, budgets outermost."""
    bar = ProgressBar(len(trace.requests) * len(budgets) * len(strategies), enabled=progress)
    results: list[RunStats] = []
    try:
        for budget in budgets:
            for strategy in strategies:
                bar.set_label(f"{budget.text} {strategy}")
                results.append(
                    replay(
                        trace,
                        memory,
                        strategy,
                        budget,
                        alpha=alpha,
                        window=window,
                        tick=bar.advance,
                        slot_ratio=slot_ratio,
                        resume_points=resume_points,
                    )
                )
    finally:
        bar.close()
    return results


def memory_figures(memory: HybridMemory, block_size: int) -> dict[str, Any]:
    kv_block = memory.block_kv_bytes(block_size)
    return {
        "model": memory.name,
        "attention_layers": memory.attention_layers,
        "linear_layers": memory.linear_layers,
        "kv_bytes_per_token": memory.kv_bytes_per_token,
        "block_size": block_size,
        "kv_bytes_per_block": kv_block,
        "conv_state_bytes_per_layer": memory.conv_state_bytes,
        "recurrent_state_bytes_per_layer": memory.recurrent_state_bytes,
        "checkpoint_bytes": memory.checkpoint_bytes,
        "every_block_bytes_per_block": kv_block + memory.checkpoint_bytes,
        "checkpoint_in_attention_blocks": memory.checkpoint_bytes / kv_block,
        "prefill_flops_per_token": memory.flops_per_token,
        "attention_flops_per_token_pair": memory.flops_per_pair,
    }


def _mib(n: float) -> str:
    return f"{n / 1024**2:,.2f} MiB"


def describe_memory(fig: dict[str, Any]) -> str:
    bs = fig["block_size"]
    return "\n".join(
        [
            f"{fig['model']}: {fig['attention_layers']} attention + "
            f"{fig['linear_layers']} linear-attention layers",
            f"  attention KV: {fig['kv_bytes_per_token']:,} B/token, "
            f"{_mib(fig['kv_bytes_per_block'])} per {bs}-token block",
            f"  state checkpoint: {fig['linear_layers']} x (conv "
            f"{fig['conv_state_bytes_per_layer']:,} B + recurrent "
            f"{fig['recurrent_state_bytes_per_layer']:,} B) = "
            f"{_mib(fig['checkpoint_bytes'])} "
            f"(= {fig['checkpoint_in_attention_blocks']:.2f} blocks of attention KV)",
            f"  checkpoint every block: {_mib(fig['every_block_bytes_per_block'])} per block, "
            f"{fig['every_block_bytes_per_block'] / bs:,.0f} B/token",
            f"  prefill: {fig['prefill_flops_per_token'] / 1e9:.2f} GFLOP/token + "
            f"{fig['attention_flops_per_token_pair'] / 1e3:,.0f} kFLOP per (query, key) pair",
        ]
    )


def _budget_label(r: RunStats, kv_block: int) -> str:
    if r.budget_bytes is None:
        return "inf"
    return f"{r.budget_bytes / _GIB:.4g} GiB ({r.budget_bytes // kv_block:,} blk)"


def render(results: Sequence[RunStats], kv_block: int, markdown: bool) -> str:
    headers = [
        "budget",
        "strategy",
        "token hit",
        "block hit",
        "kv found",
        "flop hit",
        "vs every",
        "blocks",
        "ckpts",
        "KiB/cached tok",
        "cascade",
    ]
    every = {r.budget: r for r in results if r.strategy == "every_block"}
    rows: list[list[object]] = []
    for r in results:
        base = every.get(r.budget)
        keep = "-"
        if base is not None and r.strategy != "every_block" and base.reused_blocks:
            keep = f"{r.reused_blocks / base.reused_blocks:.0%}"
        rows.append(
            [
                _budget_label(r, kv_block),
                STRATEGY_LABELS[r.strategy],
                f"{r.token_hit_ratio:.1%}",
                f"{r.block_hit_ratio:.1%}",
                f"{r.kv_found_ratio:.1%}",
                f"{r.flop_hit_ratio:.1%}",
                keep,
                f"{r.mean_blocks:,.0f}",
                f"{r.mean_checkpoints:,.0f}",
                f"{r.bytes_per_cached_token / 1024:,.1f}",
                r.cascade_drops,
            ]
        )
    return format_markdown_table(headers, rows) if markdown else format_table(headers, rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Replay a Mooncake trace through prefix caching for a hybrid model "
            "(Qwen3-Next-80B-A3B's attention KV and linear-attention state sizes) under "
            "fixed device byte budgets, comparing no hybrid caching, a state checkpoint in "
            "every block, checkpoints only where reuse is likely (Marconi-style), and "
            "kvtier's checkpoint slots. "
            "Every strategy is LRU over byte-accounted blocks and checkpoints."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=CONVERSATION_TRACE,
        help="Mooncake JSONL trace (hash_ids of 512-token prefix-chained blocks)",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--budgets",
        default=DEFAULT_BUDGETS,
        help="comma-separated device byte budgets for the cache: sizes (8GiB, 512MiB, 1TiB), "
        "counts of attention-only blocks (1000b: 1000 x the attention KV of one block), "
        "or inf for unlimited",
    )
    p.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated subset of: none (no hybrid prefix caching: nothing reusable), "
        "every_block (state checkpoint in every block), sparse (checkpoints at prompt ends "
        "and branch points only), sparse_flop (sparse with Marconi's FLOP-aware eviction "
        "instead of LRU), slots (what kvtier's engine does: --slot-ratio checkpoint slots "
        "per block, passed-over checkpoints reclaimed first)",
    )
    p.add_argument(
        "--slot-ratio",
        type=float,
        default=DEFAULT_SLOT_RATIO,
        help="slots: checkpoint slots per block of the pool (kvtier serve --window-kv-ratio)",
    )
    p.add_argument(
        "--slot-plain-lru",
        action="store_true",
        help="slots: reclaim slots least recently used first, without putting the "
        "checkpoints a request only passed first in line (an ablation)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help="sparse_flop: weight of FLOPs saved per byte against recency in the eviction "
        "score (0: plain LRU)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help="sparse_flop: how many of the least recently used evictable items are scored "
        "at each eviction",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON results")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.limit is not None and args.limit <= 0:
            raise ConfigError(f"--limit must be a positive number of requests, got {args.limit}")
        if not args.alpha >= 0:
            raise ConfigError(f"--alpha must be a number >= 0, got {args.alpha}")
        if args.window < 1:
            raise ConfigError(f"--window must be at least 1 item, got {args.window}")
        if not 0 < args.slot_ratio <= 1:
            raise ConfigError(f"--slot-ratio must be in (0, 1], got {args.slot_ratio}")
        memory = qwen3_next_memory()
        trace = load_trace(args.trace, limit=args.limit)
        if trace.format != "mooncake":
            raise ConfigError(
                f"{args.trace} is a {trace.format} trace; this benchmark replays Mooncake "
                "traces (hash_ids of 512-token blocks)"
            )
        kv_block = memory.block_kv_bytes(trace.block_size)
        budgets = parse_budgets(args.budgets, kv_block)
        strategies = parse_strategies(args.strategies)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fig = memory_figures(memory, trace.block_size)
    print(describe_memory(fig))
    log(
        f"{trace.name}: {len(trace.requests):,} requests, {trace.prompt_tokens:,} prompt "
        f"tokens, {trace.unique_blocks:,} unique blocks"
    )
    t0 = time.perf_counter()
    results = run_all(
        trace,
        memory,
        budgets,
        strategies,
        alpha=args.alpha,
        window=args.window,
        progress=want_progress(args.progress),
        slot_ratio=args.slot_ratio,
        resume_points=not args.slot_plain_lru,
    )
    elapsed = time.perf_counter() - t0
    print()
    print(render(results, kv_block, args.markdown))
    print(
        f"\n{len(results)} runs in {elapsed:.1f}s. token hit: reused prompt tokens / prompt "
        "tokens; block hit: reused / full prompt blocks; kv found: blocks whose attention KV "
        "was cached as a prefix; flop hit: prefill FLOPs saved / prefill FLOPs; vs every: "
        "reused blocks relative to checkpoint-every-block at the same budget; blocks, ckpts: "
        "mean resident; KiB/cached tok: mean bytes in use per token of cached attention KV."
    )
    write_json(
        args.out,
        {
            "benchmark": "hybrid_replay",
            "trace": str(args.trace),
            "trace_requests": len(trace.requests),
            "trace_prompt_tokens": trace.prompt_tokens,
            "trace_unique_blocks": trace.unique_blocks,
            "limit": args.limit,
            "output_tokens": "ignored (the trace has no block ids for them)",
            "eviction": "LRU, byte-accounted; chains evicted from the tail "
            "(sparse_flop: Marconi-style utility over the LRU window)",
            "alpha": args.alpha,
            "window": args.window,
            "slot_ratio": args.slot_ratio,
            "slot_plain_lru": args.slot_plain_lru,
            "memory": fig,
            "results": [r.as_dict() for r in results],
            "seconds": elapsed,
            "machine": machine_info(),
            "git": git_state(REPO),
        },
    )
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
