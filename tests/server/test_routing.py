"""Prefix-aware routing across replicas (speculant/server/scaleout/routing.py): a prompt's chain of block hashes, a
replica's ledger of what its prefix cache holds, the choice with its load rule, the proxy's hint and the
replica's record, without Ray; the router on Ray Serve's RequestRouter with stub replicas where Ray is
installed. The slow suite against a real `speculant serve --replicas 2` is tests/server/test_replicas_routing.py.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from types import SimpleNamespace

import pytest

from speculant.server.scaleout import routing
from speculant.server.scaleout.routing import (
    BLOCK_CHARS,
    MAX_BODY_BYTES,
    PREFIX_HEADER,
    AddPrefixHint,
    PrefixLedger,
    RecordPrefix,
    body_chain,
    choose_by_prefix,
    decode_chain,
    encode_chain,
    header_chain,
    matched_blocks,
    prefix_chain,
    routing_text,
)

SYSTEM = "You are a careful coding assistant. " * 8


def chat_chain(*contents: str) -> list[int]:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return body_chain(json.dumps({"messages": [{"role": r, "content": c} for r, c in zip(roles, contents)]}).encode())


# -- chains ---------------------------------------------------------------------------------------


def test_a_chain_names_each_whole_block_and_its_prefix():
    a = "x" * (3 * BLOCK_CHARS + 10)
    assert len(prefix_chain(a)) == 3  # the partial last block is not hashed
    b = a[:2 * BLOCK_CHARS] + "y" + a[2 * BLOCK_CHARS + 1:]
    ca, cb = prefix_chain(a), prefix_chain(b)
    assert ca[:2] == cb[:2] and ca[2] != cb[2]
    # The same block after a different prefix hashes differently: a hash names its whole prefix.
    z = "z" * BLOCK_CHARS
    assert prefix_chain("a" * BLOCK_CHARS + z)[1] != prefix_chain("b" * BLOCK_CHARS + z)[1]
    assert len(prefix_chain("q" * 10 * BLOCK_CHARS, max_blocks=4)) == 4


def test_a_later_turn_extends_the_earlier_turns_chain():
    turn1 = chat_chain(SYSTEM, "Write a function that reverses a list.")
    turn2 = chat_chain(SYSTEM, "Write a function that reverses a list.", "def rev(xs): return xs[::-1]", "Now in C.")
    assert turn1 and turn2[:len(turn1)] == turn1 and len(turn2) > len(turn1)
    other = chat_chain("You are a poet. " * 8, "Write a haiku.")
    assert matched_blocks(other, set(turn1)) == 0


def test_routing_text_reads_chat_and_completion_bodies():
    parts = [{"type": "text", "text": "hi"}]
    assert routing_text({"messages": [{"role": "user", "content": parts}]}) == "user\x1fhi\x1e"
    assert routing_text({"prompt": "hello"}) == routing_text({"prompt": ["hello"]}) == "hello"
    assert routing_text({"prompt": ["a", "b"]}) is None and routing_text({"prompt": [1, 2, 3]}) is None
    assert body_chain(b"{not json") == [] and body_chain(b"[1, 2]") == []


def test_the_header_round_trips_and_a_bad_one_is_ignored():
    chain = prefix_chain("k" * 5 * BLOCK_CHARS)
    assert decode_chain(encode_chain(chain)) == chain
    assert header_chain([(b"X-Speculant-Prefix", encode_chain(chain).encode())]) == chain
    assert decode_chain("zz,12") == [] and decode_chain("") == [] and header_chain([]) == []


# -- the ledger -----------------------------------------------------------------------------------


def test_the_ledger_keeps_one_entry_per_conversation_least_recent_first():
    ledger = PrefixLedger()
    c1 = prefix_chain("a" * 4 * BLOCK_CHARS)
    c1_longer = prefix_chain("a" * 7 * BLOCK_CHARS)
    c2 = prefix_chain("b" * 3 * BLOCK_CHARS)
    ledger.record(c1, 1)
    ledger.record(c2, 2)
    ledger.record(c1_longer, 3)  # the next turn: replaces its earlier one
    assert len(ledger.entries) == 2 and ledger.hashes() == set(c1_longer) | set(c2)
    ledger.record(c2[:2], 4)  # a prefix of a held entry: touches it
    assert list(ledger.entries) == [c1_longer[-1], c2[-1]]
    assert ledger.hashes(newest=1) == set(c2)
    ledger.keep_newest(1)
    assert ledger.hashes() == set(c2)
    ledger.expire(before=5)
    assert ledger.hashes() == set()


# -- the choice -----------------------------------------------------------------------------------


def ledgers() -> tuple[dict[str, set[int]], list[int], list[int]]:
    """r1 served conversation A (short), r2 served B and C (more cached overall); A's next turn."""
    a1 = chat_chain(SYSTEM, "Explain recursion.")
    a2 = chat_chain(SYSTEM, "Explain recursion.", "A function calling itself.", "Give an example.")
    b = chat_chain("You are a poet. " * 8, "Write a haiku about rain and the sea, with a twist.")
    c = chat_chain("You are a SQL expert. " * 8, "Write a query for the top 10 customers by revenue.")
    return {"r1": set(a1), "r2": set(b) | set(c)}, a1, a2


def test_a_later_turn_goes_where_its_prefix_is():
    held, a1, a2 = ledgers()
    choice = choose_by_prefix(a2, held, {"r1": 2, "r2": 1})
    assert choice.replica == "r1" and choice.reason == "prefix" and choice.matched == len(a1)


def test_load_wins_when_the_best_replica_is_imbalanced():
    held, _, a2 = ledgers()
    assert choose_by_prefix(a2, held, {"r1": 5, "r2": 1}, imbalance=4).replica == "r1"  # 4 more: still prefix
    choice = choose_by_prefix(a2, held, {"r1": 6, "r2": 1}, imbalance=4)
    assert choice.replica is None and choice.reason == "imbalanced"
    assert choose_by_prefix(a2, held, {"r1": 1, "r2": 1}, imbalance=0).replica == "r1"


def test_no_match_or_no_prefix_is_routed_by_load():
    held, _, _ = ledgers()
    assert choose_by_prefix(chat_chain("Unseen. " * 20, "hi"), held, {"r1": 0, "r2": 0}).reason == "no_match"
    assert choose_by_prefix([], held, {"r1": 0, "r2": 0}).reason == "no_prefix"


def test_ties_go_to_the_least_loaded_and_unknown_queues_count_as_the_least():
    chain = prefix_chain("s" * 6 * BLOCK_CHARS)
    held = {"r1": set(chain), "r2": set(chain)}
    assert choose_by_prefix(chain, held, {"r1": 3, "r2": 1}).replica == "r2"
    assert choose_by_prefix(chain, held, {"r1": None, "r2": 1}).replica == "r1"


def longest_anywhere(chain, held):  # mutant: ignores where the matching block sits in the prompt
    return len(held)


def position_blind(chain, held):  # mutant: counts the prompt's blocks held anywhere, prefix or not
    return 1 if set(chain) & held else 0


@pytest.mark.parametrize("matcher, routes_right", [
    (matched_blocks, True), (longest_anywhere, False), (position_blind, False)],
    ids=["prefix", "mutant: most cached", "mutant: any shared block"])
def test_a_matcher_that_ignores_the_prefix_is_caught(monkeypatch, matcher, routes_right):
    monkeypatch.setattr(routing, "matched_blocks", matcher)
    held, _, a2 = ledgers()
    # r2 also holds a long shared system prompt that diverges from A after one block: a shorter prefix.
    shared = chat_chain(SYSTEM[:BLOCK_CHARS] + "Other rules follow. " * 20, "Something else entirely.")
    held["r2"] |= set(shared)
    choices = [choose_by_prefix(a2, held, {"r1": 0, "r2": 0}).replica]
    held_swapped = {"r1": held["r2"], "r2": held["r1"]}  # the same with the names swapped
    choices.append(choose_by_prefix(a2, held_swapped, {"r1": 0, "r2": 0}).replica)
    assert (choices == ["r1", "r2"]) is routes_right, choices


# -- the proxy's hint, the replica's record -------------------------------------------------------


def call(middleware_app, scope: dict, messages: list[dict]) -> tuple[dict, bytes, list[dict]]:
    """(the scope the inner app saw, the body it read, what it sent)."""
    seen: dict = {}
    sent: list[dict] = []

    async def inner(scope, receive, send):
        seen["scope"], body = scope, b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen["body"] = body
        await send({"type": "http.response.start", "status": seen.get("status", 200), "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)

    async def send(m):
        sent.append(m)

    asyncio.run(middleware_app(inner)(scope, receive, send))
    return seen["scope"], seen["body"], sent


def post(path: str = "/v1/chat/completions", headers=()) -> dict:
    return {"type": "http", "method": "POST", "path": path, "headers": list(headers)}


def test_the_proxy_puts_the_chain_in_a_header_and_replays_the_body():
    body = json.dumps({"model": "m", "messages": [{"role": "system", "content": SYSTEM}]}).encode()
    parts = [{"type": "http.request", "body": body[:50], "more_body": True},
             {"type": "http.request", "body": body[50:], "more_body": False}]
    forged = (PREFIX_HEADER.encode(), b"0000000000000001")
    scope, got, _ = call(AddPrefixHint, post(headers=[forged, (b"host", b"x")]), parts)
    assert got == body
    assert header_chain(scope["headers"]) == body_chain(body) != []
    assert forged not in scope["headers"] and (b"host", b"x") in scope["headers"]


def test_the_proxy_leaves_other_requests_unhinted():
    forged = (PREFIX_HEADER.encode(), b"0000000000000001")
    body = json.dumps({"messages": [{"role": "user", "content": SYSTEM}]}).encode()
    msg = [{"type": "http.request", "body": body, "more_body": False}]
    for scope in (post("/v1/models", [forged]), {**post(headers=[forged]), "method": "GET"}):
        seen, got, _ = call(AddPrefixHint, scope, msg)
        assert got == body and header_chain(seen["headers"]) == []


def test_a_large_or_slow_body_goes_on_unhinted_and_whole():
    big = b"x" * (MAX_BODY_BYTES + 10)
    chunks = [{"type": "http.request", "body": big[i:i + (1 << 20)], "more_body": i + (1 << 20) < len(big)}
              for i in range(0, len(big), 1 << 20)]
    scope, got, _ = call(AddPrefixHint, post(), chunks)
    assert got == big and header_chain(scope["headers"]) == []
    body = json.dumps({"messages": [{"role": "user", "content": SYSTEM}]}).encode()
    first = [{"type": "http.request", "body": body[:10], "more_body": True}]

    async def run():
        sent_rest = asyncio.Event()
        queue = list(first)

        async def receive():
            if queue:
                return queue.pop(0)
            await sent_rest.wait()
            return {"type": "http.request", "body": body[10:], "more_body": False}

        seen = {}

        async def inner(scope, receive_, send):
            seen["scope"] = scope
            sent_rest.set()  # the client sends the rest only once the app reads on
            m1, m2 = await receive_(), await receive_()
            seen["body"] = m1["body"] + m2["body"]

        await AddPrefixHint(inner, wait_s=0.2)(post(), receive, None)
        return seen

    seen = asyncio.run(run())
    assert seen["body"] == body and header_chain(seen["scope"]["headers"]) == []


def test_the_replica_records_what_it_answered_in_full():
    chain = prefix_chain("r" * 4 * BLOCK_CHARS)
    ledger, arrivals = PrefixLedger(), []
    hinted = post(headers=[(PREFIX_HEADER.encode(), encode_chain(chain).encode())])

    def app(inner):
        return RecordPrefix(inner, ledger, arrived=arrivals.append, clock=lambda: 7.0)

    _, _, sent = call(app, hinted, [{"type": "http.request", "body": b"{}", "more_body": False}])
    assert sent[0]["status"] == 200 and ledger.hashes() == set(chain) and arrivals == [chain]
    assert ledger.entries[chain[-1]][1] == 7.0
    call(app, post(), [{"type": "http.request", "body": b"{}", "more_body": False}])  # no chain: no record
    assert len(arrivals) == 1


def test_a_failed_request_is_not_recorded():
    chain = prefix_chain("f" * 4 * BLOCK_CHARS)
    ledger = PrefixLedger()

    async def failing(scope, receive, send):
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    scope = post(headers=[(PREFIX_HEADER.encode(), encode_chain(chain).encode())])

    async def send(m):
        pass

    asyncio.run(RecordPrefix(failing, ledger)(scope, None, send))
    assert ledger.hashes() == set()


# -- the router on Ray Serve's RequestRouter (stub replicas) ---------------------------------------


def stub_replica(uid: str, hashes: list[int]):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats={"prefix_hashes": hashes},
                           max_ongoing_requests=8)


def stub_router(imbalance: int = 4, queues: dict | None = None):
    pytest.importorskip("ray.serve", reason="ray is not installed")
    from speculant.server.scaleout.ray_serve import PrefixAffinityRouter

    router = object.__new__(PrefixAffinityRouter)
    router.initialize_state(imbalance=imbalance)
    queues = queues or {}
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: queues.get(rid.unique_id, 0))
    return router


def pending(request_id: str, chain: list[int] = (), session: str = ""):
    headers = [(PREFIX_HEADER.encode(), encode_chain(chain).encode())] if chain else []
    return SimpleNamespace(args=[SimpleNamespace(asgi_scope={"headers": headers})],
                           metadata=SimpleNamespace(internal_request_id=request_id, session_id=session),
                           routing_context=SimpleNamespace(should_backoff=False))


def test_the_ray_router_ranks_the_holder_first():
    pytest.importorskip("ray.serve", reason="ray is not installed")
    from speculant.server.scaleout.ray_serve import request_chain

    held, _, a2 = ledgers()
    r1, r2 = stub_replica("r1", sorted(held["r1"])), stub_replica("r2", sorted(held["r2"]))
    router = stub_router(queues={"r1": 1, "r2": 0})
    assert request_chain(pending("q", a2)) == a2
    # As Ray's proxy sends it: its StreamingHTTPRequest, pickled for the replica.
    from ray.serve._private.common import StreamingHTTPRequest

    scope = {"headers": [(PREFIX_HEADER.encode(), encode_chain(a2).encode())]}
    as_sent = pickle.dumps(StreamingHTTPRequest(asgi_scope=scope, proxy_actor_name="proxy"))
    assert request_chain(SimpleNamespace(args=[as_sent])) == a2
    assert request_chain(SimpleNamespace(args=[b"not a pickle"])) == []
    assert asyncio.run(router.choose_replicas([r2, r1], pending("q", a2))) == [[r1]]
    # What it routed counts as held before the replica reports it.
    b = chat_chain("Brand new prompt. " * 10, "Question.")
    router.on_request_routed(pending("q2", b), r2.replica_id, None)
    assert router.held(r2) >= set(b) and not router.held(r1) & set(b)


def test_a_burst_of_new_prompts_spreads_and_completions_free_their_replica():
    r1, r2 = stub_replica("r1", []), stub_replica("r2", [])
    router = stub_router()  # Ray's queue lengths say 0 throughout: they lag a burst

    async def burst():
        return await asyncio.gather(*(router.choose_replicas(
            [r1, r2], pending(f"q{i}", prefix_chain(f"conversation {i} " * 20))) for i in range(8)))

    firsts = [ranks[0][0].replica_id.unique_id for ranks in asyncio.run(burst())]
    assert sorted(firsts) == ["r1"] * 4 + ["r2"] * 4
    for i, replica in enumerate(firsts):
        router.on_request_routed(pending(f"q{i}"), SimpleNamespace(unique_id=replica), None)
        router.on_request_completed(None, f"q{i}")
    assert router.load["r1"] == router.load["r2"] == 0 and not router.outstanding


def test_a_turn_longer_than_the_hold_is_held_from_its_answer_until_the_replica_reports():
    r1, r2 = stub_replica("r1", []), stub_replica("r2", [])  # neither has reported anything yet
    router = stub_router()
    now = [0.0]
    router.clock = lambda: now[0]
    first = chat_chain("You help with Python. " * 8, "Write a function.")
    later = chat_chain("You help with Python. " * 8, "Write a function.", "def f(): pass", "Now test it.")
    ranks = asyncio.run(router.choose_replicas([r1, r2], pending("t1", first)))
    home = ranks[0][0]
    router.on_request_routed(pending("t1"), home.replica_id, None)
    now[0] = router.hold_s + 10  # the first turn ran past the hold
    router.on_request_completed(home.replica_id, "t1")
    now[0] += 0.5  # the next turn comes at once, before any report
    assert asyncio.run(router.choose_replicas([r1, r2], pending("t2", later)))[0] == [home]


def test_the_holder_is_tried_alone_while_it_has_room_then_with_the_others(caplog):
    held, _, a2 = ledgers()
    r1, r2 = stub_replica("r1", sorted(held["r1"])), stub_replica("r2", sorted(held["r2"]))
    router = stub_router(queues={"r1": 1, "r2": 0})
    from speculant.server.scaleout.ray_serve import HOME_TRIES

    request = pending("q", a2)
    tries = [asyncio.run(router.choose_replicas([r1, r2], request)) for _ in range(HOME_TRIES + 1)]
    assert tries[:HOME_TRIES] == [[[r1]]] * HOME_TRIES and tries[-1] == [[r1], [r2]]
    assert request.routing_context.should_backoff  # a fleet with no room backs off, not spins
    assert router.load["r1"] == 1  # its tries count once
    import logging

    proxy_log = logging.getLogger("ray.serve")  # Ray's: it does not propagate to the root logger
    proxy_log.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="ray.serve"):
            router.on_request_routed(request, r2.replica_id, None)  # Ray took the second rank
    finally:
        proxy_log.removeHandler(caplog.handler)
    assert f"request q went to r2, not to r1 which holds {len(a2)} blocks" in caplog.text, caplog.text
    assert router.load == {"r1": 0, "r2": 1}
    full = stub_router(imbalance=8, queues={"r1": 8, "r2": 0})  # the holder is at max_ongoing_requests
    assert asyncio.run(full.choose_replicas([r1, r2], pending("q", a2))) == [[r1], [r2]]
    fresh = pending("new", prefix_chain("A prompt no replica holds. " * 10))
    assert len(asyncio.run(router.choose_replicas([r1, r2], fresh))) == 2  # load's choice insists on nothing


def test_a_negative_imbalance_fails_with_one_line_before_loading():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "speculant.cli", "serve", "--replicas", "2", "--routing-imbalance",
                           "-1"], capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and lines == ["error: --routing-imbalance must be at least 0, got -1"], proc.stderr
