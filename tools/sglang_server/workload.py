"""The requests of the server tests: deterministic token ids that force write-back, eviction and load-back.

Correctness (``correctness()``), against a device pool of ``DEVICE_TOKENS`` tokens at page 64:

* ``fill``: one request per prefix (``PREFIXES`` x ``PREFIX`` tokens, then a suffix): together more
  than the device pool holds, so the earliest prefixes are evicted from the device once written
  through to the host;
* ``reload``: every prefix again, with another suffix: the evicted ones are host hits (loaded back
  from the host pool), counted from ``meta_info["cached_tokens_details"]``;
* ``sensitivity``: two fresh prompts that differ in one token near the start: their outputs must
  differ, or the model's output does not depend on its prompt and equal outputs prove nothing.

Every request is greedy with ``ignore_eos``, and they are sent one at a time, so two servers that load
back the same bytes produce the same token ids and logprobs.

TTFT (``ttft_rounds()``): per prefix length, rounds of a fresh prefix, fillers that evict it from the
device, the prefix again (a host hit, timed) and once more (a device hit, timed). With ``alternate``
(the real-size runs), odd rounds time the device hit first, right after the miss, and the host hit
after the fillers: the order of the two hits never favours one side.

TPOT (``tpot_decoders()``, ``tpot_traffic()``): the steady decode batch, and the request streams that
run beside it: fresh prompts (each written through to the host: backups) or a ring of prefixes that
the decoders and each other keep evicting from the device (each request a host hit: loads).
"""

from __future__ import annotations

import random

PAGE = 64
PREFIXES = 8
PREFIX = 1024
SUFFIX = 32
NEW_TOKENS = 8
DEVICE_TOKENS = 4096  # < PREFIXES * (PREFIX + SUFFIX + NEW_TOKENS): the fill phase evicts
HOST_RATIO = 4.0  # the host pool holds every prefix
FIRST_ID = 4  # ids below are special tokens


def _ids(rng: random.Random, n: int, vocab: int) -> list:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def correctness(vocab: int, *, seed: int = 0, prefixes: int = PREFIXES, prefix: int = PREFIX,
                suffix: int = SUFFIX, new_tokens: int = NEW_TOKENS) -> list:
    """The requests, in the order they are sent: dicts with id, phase, input_ids, max_new_tokens."""
    rng = random.Random(seed)
    bodies = [_ids(rng, prefix, vocab) for _ in range(prefixes)]
    requests = []
    for phase in ("fill", "reload"):
        for i, body in enumerate(bodies):
            requests.append({"id": f"{phase}-{i}", "phase": phase, "prefix": i,
                             "input_ids": body + _ids(rng, suffix, vocab), "max_new_tokens": new_tokens})
    probe = _ids(rng, prefix // 4, vocab)
    changed = list(probe)
    changed[3] = FIRST_ID + (changed[3] - FIRST_ID + 1) % (vocab - FIRST_ID)
    for name, ids in (("sensitivity-a", probe), ("sensitivity-b", changed)):
        requests.append({"id": name, "phase": "sensitivity", "prefix": None, "input_ids": ids,
                         "max_new_tokens": new_tokens})
    return requests


def expected_evictions(prefixes: int = PREFIXES, prefix: int = PREFIX, suffix: int = SUFFIX,
                       new_tokens: int = NEW_TOKENS, device_tokens: int = DEVICE_TOKENS) -> int:
    """Tokens the fill phase puts on the device beyond its pool (> 0: something is evicted)."""
    return prefixes * (prefix + suffix + new_tokens) - device_tokens


def ttft_rounds(vocab: int, lengths=(2048, 8192, 32768), *, rounds: int = 5, device_tokens: int,
                suffix: int = PAGE, seed: int = 1, alternate: bool = False) -> list:
    """Per length and round: the prompts of one measurement.

    ``warm``: the prefix plus a suffix (full prefill; written through to the host);
    ``fillers``: fresh prompts of ``device_tokens`` tokens in all, which evict the prefix from the device;
    ``host``: the prefix plus another suffix (its prefix is a host hit: the TTFT users feel);
    ``device``: the prefix plus a third suffix (now a device hit).

    With ``alternate`` every round sends the same fillers: computed once in the first round, later they
    come back from the host (each is the least recently used, so none is on the device when asked for).
    They are still more recent than the prefix and more tokens than the device holds, so least-recently-
    used eviction still removes the whole prefix, at the cost of a load instead of a prefill.
    """
    rng = random.Random(seed)
    out = []
    filler_len = 8192

    def fresh_fillers():
        return [_ids(rng, filler_len, vocab) for _ in range(-(-device_tokens // filler_len) + 1)]

    shared = fresh_fillers() if alternate else None
    for length in lengths:
        for r in range(rounds):
            body = _ids(rng, length, vocab)
            fillers = shared if shared is not None else fresh_fillers()
            out.append({"length": length, "round": r, "warm": body + _ids(rng, suffix, vocab), "fillers": fillers,
                        "host": body + _ids(rng, suffix, vocab), "device": body + _ids(rng, suffix, vocab),
                        "device_first": alternate and r % 2 == 1})
    return out


def tpot_decoders(vocab: int, count: int, prompt: int = 128, seed: int = 4) -> list:
    """``count`` prompts of the steady decode batch (each decoder restarts its own prompt when it ends)."""
    rng = random.Random(seed)
    return [_ids(rng, prompt, vocab) for _ in range(count)]


def tpot_traffic(vocab: int, kind: str, count: int, *, length: int = 8192, ring: int = 6, suffix: int = PAGE,
                 seed: int = 5) -> dict:
    """The requests sent beside the decode batch, in order: ``{"warm": [...], "stream": [...]}``.

    ``backups``: ``count`` fresh prompts of ``length`` tokens (each computed and written through);
    ``loads``: ``ring`` prefixes of ``length`` tokens, sent first (``warm``, before the timed window),
    then re-requested in turn with fresh suffixes: each is the least recently used, so the decoders and
    the ring keep it off the device, and every request of the stream is a host hit;
    ``quiet``: nothing.
    The same seed gives every mode the same stream."""
    rng = random.Random(seed)
    if kind == "quiet":
        return {"warm": [], "stream": []}
    if kind == "backups":
        return {"warm": [], "stream": [_ids(rng, length, vocab) for _ in range(count)]}
    if kind == "loads":
        prefixes = [_ids(rng, length, vocab) for _ in range(ring)]
        warm = [p + _ids(rng, suffix, vocab) for p in prefixes]
        return {"warm": warm, "stream": [prefixes[i % ring] + _ids(rng, suffix, vocab) for i in range(count)]}
    raise ValueError(f"kind must be quiet, backups or loads, not {kind!r}")


def warm_up(vocab: int, length: int = 8192, seed: int = 6) -> list:
    """One prompt of ``length`` tokens that no other workload sends: an engine computes it (and a short decode)
    before a TPOT-only run, so the first timed window does not wait for the kernels' first builds."""
    return _ids(random.Random(seed), length, vocab)


def decoders(vocab: int, count: int = 8, prompt: int = 512, seed: int = 2) -> list:
    """Prompts of the background requests that decode while TTFT is measured."""
    rng = random.Random(seed)
    return [_ids(rng, prompt, vocab) for _ in range(count)]
