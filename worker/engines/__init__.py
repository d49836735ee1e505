"""The generation engines, one module each, behind one interface; worker/generate.py picks one and runs it.

    padded.py            micro-batches through `model.generate` (`engine: padded`; `auto` off CUDA)
    static.py            `model.generate` with a static KV cache, compiled once per shape (`engine: static`)
    continuous.py        transformers' continuous batching, driven through its manager (`engine: continuous`)
    fast.py              ours (`engine: fast`; `auto` on CUDA), as the dispatcher runs it; the engine itself is
    fastgen.py           (continuous batching, CUDA graphs, compiled layers: the engine and its loop) over
    slot_state.py        (its resident state: the paged KV cache, page table and slot inputs, and their sizing),
    pages.py             (which pages are free, in use, or cached prompt prefixes), with its attention
    paged_attention.py   (what transformers' layers call: reads and writes the paged cache) and its kernel
    decode_attention.py  (Triton decode attention over the pages)
    common.py            what they share: rows rendered to token ids, results built from sequences, EOS ids, the
                         padded attention, `model.generate` arguments, the allocator's cache given back after OOM
    grammar.py           structured outputs: grammars compiled per tokenizer, a matcher per sequence, the mask
    logprobs.py          log-probabilities of the generated tokens (both add nothing to a step no row asks them of)

The interface, the same in every engine module:

    run(loaded, spec, rows, *, batch_rows, should_stop, on_event, info, progress) -> Iterator[list[RowResult]]

`rows` = [(idx, stored row input)]; each yielded list is one micro-batch the caller commits before asking for the
next. `info` receives what ran (attention, CUDA graphs, cache, compile times), `progress` every decode step (the
stall watchdog's clock, worker/progress.py), `on_event` each out-of-memory retry. `should_stop()` is checked
between steps: rows not yet yielded then stay pending.

An engine imports `common`, never another engine. The one hand-off between engines goes through the dispatcher:
the fast engine's `run` *returns* (the generator's return value) the rows it cannot run under `auto` — sampling it
does not do, or longer than its cache holds — and `generate.run_engine` runs them on the padded engine after it.
"""
