"""Server parts without a server: the /metrics text format, the prompt cache's choices and memory bound,
the pre-serialised SSE chunk."""

from __future__ import annotations

import re

import pytest

from edgerun.serve.metrics import GenerationRecord, Metrics


_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
                     r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*\})? (-?[0-9.e+-]+|NaN|[+-]Inf)$')


def test_metrics_exposition_format():
    m = Metrics(model='odd "name"\\x')
    m.count_request("/v1/completions", 200)
    m.count_request("/v1/completions", 503)
    m.record_generation(GenerationRecord(n_prompt_tokens=5, n_tokens=11, t_decode_s=2.0, n_drafted=8, n_accepted=6,
                                         gamma_mean=4.0, ttft_s=0.3, outcome="length"))
    m.record_generation(GenerationRecord(n_prompt_tokens=0, n_tokens=0, t_decode_s=0.0, n_drafted=0, n_accepted=0,
                                         gamma_mean=None, ttft_s=None, outcome="cancelled"))
    text = m.render(queue_depth=2, queue_limit=8, busy=True, ready=True)
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) edgerun_\w+ .+", line), line
            continue
        assert _SAMPLE.match(line), line
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    assert values["edgerun_acceptance_rate"] == 0.75 and values["edgerun_gamma"] == 4
    assert values["edgerun_tokens_per_second"] == 5.5 and values["edgerun_tokens_generated_total"] == 11
    assert values['edgerun_time_to_first_token_seconds_bucket{le="0.25"}'] == 0
    assert values['edgerun_time_to_first_token_seconds_bucket{le="0.5"}'] == 1
    assert values['edgerun_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1
    assert values['edgerun_requests_total{endpoint="/v1/completions",status="503"}'] == 1
    assert values['edgerun_generations_total{outcome="cancelled"}'] == 1
    assert values["edgerun_queue_depth"] == 2 and values["edgerun_busy"] == 1
    assert values['edgerun_ready{model="odd \\"name\\"\\\\x"}'] == 1


def test_prompt_cache_keeps_the_longest_prefix_within_its_bytes():
    from edgerun.backends.llamacpp import SeqState
    from edgerun.serve.promptcache import PromptCache

    def st(toks, n=100):
        return SeqState(tuple(toks), b"\0" * n)

    c = PromptCache(max_bytes=3 * (100 + 8 * 4))
    c.put(st([1, 2, 3, 4]))
    c.put(st([1, 2]))                         # a prefix of an entry: not kept twice
    assert len(c) == 1
    c.put(st([1, 2, 3, 4, 5, 6]))             # extends the entry: replaces it
    assert len(c) == 1 and c.best([1, 2, 3, 4, 5, 9])[0] == 5
    c.put(st([7, 8, 9, 10]))
    c.put(st([11, 12, 13, 14]))
    assert c.best([7, 8, 0])[0] == 2          # used: now the most recent
    c.put(st([15, 16, 17, 18]))               # over the bound: the least recently used ([1..6]) goes
    assert c.best([1, 2, 3])[0] == 0 and c.best([7, 8])[0] == 2 and c.nbytes <= c.max_bytes
    c.put(st([1], n=10_000))                  # larger than the whole cache: not kept
    assert c.best([1])[0] == 0


def test_prompt_cache_never_takes_more_than_a_quarter_of_the_available_ram(monkeypatch, caplog):
    import collections

    import psutil

    from edgerun.serve import promptcache

    vm = collections.namedtuple("vm", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm(400 * 2**20))
    assert promptcache.sized(0) is None
    assert promptcache.sized(64).max_bytes == 64 * 2**20
    with caplog.at_level("WARNING", logger="edgerun.serve.promptcache"):
        assert promptcache.sized(256).max_bytes == 100 * 2**20
    assert "keeping it to 100 MiB" in caplog.text


def test_a_pre_serialised_chunk_is_the_chunk_serialised_byte_for_byte():
    """A streamed token's SSE chunk is built from the stream's chunk serialised once (sse_framer): it must be
    exactly what serialising the whole chunk with the token's text gives, whatever the text holds."""
    from edgerun.serve.protocol import sse_data, sse_framer

    mark = "\ue000mark\ue000"

    def chunk(text):
        return {"id": "chatcmpl-x", "created": 1, "model": "m\"odel", "system_fingerprint": None,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}

    frame = sse_framer(chunk(mark), mark)
    for text in ["hi", " wörld ✓", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f", "\ud83d",
                 "\U0001f600", "", mark[1:]]:
        assert frame(text) == sse_data(chunk(text)), text
    with pytest.raises(ValueError, match="exactly one"):
        sse_framer({"a": mark, "b": mark}, mark)
    with pytest.raises(ValueError, match="exactly one"):
        sse_framer({"a": "x"}, mark)
