"""Which decoder families kvtier serves exactly, found by running them.

A family is admitted by evidence: :mod:`kvtier.conformance.sweep` builds a
tiny random-weight model from each causal-LM config class of the installed
transformers (:mod:`kvtier.conformance.tiny`), serves it through kvtier's
engine in the cases that stress the cache (:mod:`kvtier.conformance.cases`:
long prompts crossing windows and blocks, batches sharing a prefix with
chunked prefill, preemption, a host-tier round trip, a request moved
between engines) and compares every token with transformers' own greedy
``generate``. The outcome per family (exact, refused with the reason, or not
buildable tiny) is the record :mod:`kvtier.layers.support` admits by
(``kvtier/layers/families.json``); ``bench/families.py`` reruns the sweep,
prints the table and rewrites the record and ``docs/models.md``.

Needs torch and transformers.
"""
