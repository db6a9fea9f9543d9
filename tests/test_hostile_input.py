"""Hostile input to the REST API: requests generated from the contract (jupyter_gpushare/
openapi.yaml) for every operation, valid and not (wrong types, deep nesting, huge numbers,
unicode, empty and invalid JSON, NaN/Infinity, ids that exist and that do not, wrong
methods and tokens), sent to a real server with real kernels.

For every request: never a 5xx; the answer validates against the contract; a refused request
changes nothing; an accepted one changes exactly what it asked for. Set
``GPUSHARE_FUZZ_EXAMPLES`` to run more cases than CI does (default 400).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from tornado.httpclient import HTTPClientError

from jupyter_gpushare.server import contract

from .helpers import KernelConn, rest, wait_for

EXAMPLES = int(os.environ.get("GPUSHARE_FUZZ_EXAMPLES", "400"))
MiB = 1 << 20
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
WITH_BODY = ("POST", "PUT", "PATCH")  # tornado's client sends a body with these only


# -- the oracle: is a request valid by the contract? ------------------------------------------
def _reject(value: str) -> Any:
    raise ValueError(f"{value} is not JSON")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({k for k, _ in pairs}) != len(pairs):
        raise ValueError("repeated key")
    return dict(pairs)


def strict_json(raw: bytes | str) -> tuple[bool, Any]:
    """(parsed?, value) under RFC 8259: no NaN/Infinity; keys unique, as the API asks."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return True, json.loads(text, parse_constant=_reject, object_pairs_hook=_unique)
    except (ValueError, RecursionError):
        return False, None


def query_valid(raw: str, schema: dict[str, Any]) -> bool:
    ok, value = strict_json(raw)
    if not ok or raw != raw.strip() or isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) and contract.validator(schema).is_valid(value)


def body_valid(raw: bytes, schema: dict[str, Any]) -> bool:
    ok, value = strict_json(raw)
    return ok and contract.validator(schema).is_valid(value)


# -- generating requests from the contract ----------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
NASTY_NUMBERS = st.sampled_from([
    "nan", "NaN", "inf", "-inf", "Infinity", "-Infinity", "1e999", "-1e999", "1e-400", "0", "-0",
    "", " 5", "5 ", "1_000", "\u0665", "\uff15", "0x10", "1.", ".5", "+5", "05", "604800",
    "604800.0000001", "604801", "100%", "%25", "5\x00", "9" * 400, "true", "null", "[1]",
])


def deep(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


NASTY_BODIES = st.sampled_from([
    b"", b"{", b"null", b"[]", b"[1]", b'"pinned"', b"{}", b'{"pinned": 1}', b'{"pinned": null}',
    b'{"pinned": "true"}', b'{"pinned": NaN}', b'{"pinned": Infinity}', b'{"pinned": true}x',
    b'{"pinned": false, "pinned": true}', b'{"pinned": true, "idle_timeout": 0}',
    '\ufeff{"pinned": true}'.encode(), b'{"pinned": true}'.decode().encode("utf-16"),
    b"\xff\xfe\x00", '{"pinned": "\u00e9\U0001f600"}'.encode(),
]) | st.integers(1, 2100).map(lambda d: deep(d).encode()) \
   | st.integers(1, 1000).map(lambda d: ('{"pinned": ' + deep(d) + "}").encode()) \
   | st.integers(1, 700).map(lambda d: deep(d, '{"a":', "}").replace('"a":}', '"a":1}').encode()) \
   | st.builds(lambda: b" " * 5000 + b'{"pinned": true}') \
   | st.builds(lambda: deep(100_000).encode())
# (large bodies are built, not given as values: a strategy's repr holds its values, and
# hypothesis prints that repr, 200 KB of it, in warnings and failure reports)


NASTY_ACTION_BODIES = st.sampled_from([  # release / restore: no body, {} or {"trigger": "panel"}
    b"", b"{}", b'{"trigger": "panel"}', b'{"trigger": "PANEL"}', b'{"trigger": "rest"}',
    b'{"trigger": null}', b'{"trigger": ["panel"]}', b'{"trigger": "panel", "x": 1}',
    b'{"trigger": "panel", "trigger": "panel"}', b'{"trigger": "pan\\u0065l"}',
])


@dataclass
class World:
    """A resident kernel and a released one; every case starts from this."""

    resident: KernelConn
    released: KernelConn
    ids: list[str] = field(default_factory=list)


@dataclass(repr=False)
class Case:
    op: contract.Operation
    method: str
    path_params: dict[str, str]
    query: dict[str, str]
    body: bytes | None
    auth: str  # "ok", "missing", "wrong"

    def __repr__(self) -> str:
        body = self.body if self.body is None or len(self.body) <= 120 else \
            self.body[:120] + f"... ({len(self.body)} bytes)".encode()
        return (f"Case({self.method} {self.op.path} path={self.path_params!r} "
                f"query={self.query!r} body={body!r} auth={self.auth})")

    def parts(self) -> list[str]:
        path = self.op.path
        for name, value in self.path_params.items():
            path = path.replace("{" + name + "}", value)
        return ["api", "gpushare", *path.strip("/").split("/")]


def cases(world: World) -> st.SearchStrategy[Case]:
    per_op = []
    for op in contract.operations():
        per_op.append(_case_for(op, world))
    return st.one_of(per_op)


def _case_for(op: contract.Operation, world: World) -> st.SearchStrategy[Case]:
    path_params: dict[str, st.SearchStrategy[str]] = {}
    query: dict[str, st.SearchStrategy[Any]] = {}
    for param in op.parameters:
        schema = param["schema"]
        if param["in"] == "path":
            path_params[param["name"]] = st.one_of(
                st.sampled_from(world.ids),  # kernels that exist (twice as likely)
                st.sampled_from(world.ids),
                from_schema(schema),  # well-formed ids of kernels that do not
                st.text(max_size=40),  # anything
            )
        elif param["in"] == "query":
            valid = from_schema(schema).map(lambda v: json.dumps(v))
            query[param["name"]] = st.none() | valid | NASTY_NUMBERS | st.text(max_size=30)
    body_schema = op.request_body_schema()
    if body_schema is not None:
        bodies = st.one_of(
            from_schema(contract.resolve(body_schema)).map(lambda v: json.dumps(v).encode()),
            JSON_VALUES.map(lambda v: json.dumps(v).encode()),
            NASTY_BODIES,
            st.binary(max_size=64),
            NASTY_ACTION_BODIES,
        )
    else:
        bodies = st.just(b"") | st.sampled_from([b"{}", b'{"pinned": true}', deep(5000).encode()])
    wrong_methods = [m for m in METHODS if m != op.method.upper()]
    return st.builds(
        Case,
        op=st.just(op),
        method=st.sampled_from([op.method.upper()] * 8 + wrong_methods),
        path_params=st.fixed_dictionaries(path_params),
        query=st.fixed_dictionaries({}, optional=query).map(
            lambda q: {k: v for k, v in q.items() if v is not None}),
        body=bodies,
        auth=st.sampled_from(["ok"] * 10 + ["missing", "wrong"]),
    )


# -- what a case may change --------------------------------------------------------------------
def snapshot(app: Any, world: World) -> dict[str, tuple]:
    out = {}
    for kid in world.ids:
        s = app.controller.get(kid)
        out[kid] = (s.state, s.pinned, s.released_bytes, dict(s.released_gpus), s.releases,
                    s.restores, s.error, s.waiting, s.idle_timeout)
    out["node"] = (app.node.used(0), app.node.used(1))
    return out


def expected_outcome(case: Case, world: World) -> tuple[int, str | None]:
    """(status, what changes) for a valid request with a good token on the canonical world."""
    kid = case.path_params.get("kernel_id")
    if kid is not None and kid not in world.ids:
        return 404, None
    if case.op.path == "/kernels/{kernel_id}/release":
        if "if_idle_for" in case.query:  # only as an automatic release: these servers have
            return 409, None  # idle_timeout 0, so none of their kernels is ever taken that way
        return (200, "released") if kid == world.resident.id else (409, None)
    if case.op.path == "/kernels/{kernel_id}/restore":
        if _trigger(case) == "activity":  # a hint: answered at once, restored in the background
            return (202, "restored ahead") if kid == world.released.id else (200, None)
        return (200, "restored") if kid == world.released.id else (409, None)
    if case.op.path == "/kernels/{kernel_id}/pin":
        return 200, "pinned"
    if case.op.path == "/kernels/{kernel_id}/cap":
        return 200, "capped"
    return 200, None


def _trigger(case: Case) -> str | None:
    """The valid body's ``trigger`` (None: no body, or none said)."""
    body = json.loads(case.body) if case.body and case.body.strip() else {}
    return body.get("trigger") if isinstance(body, dict) else None


async def send(fetch: Any, case: Case) -> tuple[int, Any]:
    headers = {"missing": {"Authorization": ""}, "wrong": {"Authorization": "token nope"}}
    kw: dict[str, Any] = {"method": case.method, "params": case.query,
                          "headers": dict(headers.get(case.auth, {})),
                          "allow_nonstandard_methods": True, "raise_error": False}
    kw["body"] = (case.body or b"") if case.method in WITH_BODY else None
    try:
        r = await fetch(*case.parts(), **kw)
    except HTTPClientError as e:  # raise_error=False still raises for 599s
        raise AssertionError(f"no answer: {e}") from e
    return r.code, r.body


async def settled(app: Any, world: World) -> None:
    """Until no release or restore is in flight on the world's kernels. A restore may outlive
    the case that asked for it (a restore ahead, or one waiting for memory, is answered at
    once and goes on in the background): in a full run on a loaded machine the next case
    started with the released kernel still restoring, and its own request was blamed for the
    change, or refused with 409."""
    deadline = time.monotonic() + 120  # a bound for a loaded machine, not a timing
    while any(app.controller.get(k).op is not None for k in world.ids):
        assert time.monotonic() < deadline, "an operation on the world's kernels never ended"
        await asyncio.sleep(0.05)


def canonical(app: Any, world: World) -> bool:
    ctl = app.controller
    return not ctl.get(world.resident.id).held and bool(ctl.get(world.released.id).held)


async def reset(app: Any, world: World) -> None:
    """Back to the canonical world after a case changed it (as it was allowed to)."""
    ctl = app.controller
    await settled(app, world)
    for kid in world.ids:
        if ctl.get(kid).pinned:
            ctl.set_pinned(kid, False)
        if ctl.get(kid).own_cap is not None:  # its agent follows before the restore below
            ctl.set_memory_cap(kid, None)
            app.tell_cap(kid)
    if ctl.get(world.resident.id).held:
        await ctl.restore(world.resident.id, trigger="rest")
    if not ctl.get(world.released.id).held:
        await app.poll_once()
        await ctl.release(world.released.id, reason="test reset")
    await app.poll_once()


async def check_case(fetch: Any, app: Any, world: World, case: Case, generated: bool = True) -> int:
    await settled(app, world)  # what the server did on its own before this case is not its doing
    if not canonical(app, world):
        await reset(app, world)
    before = snapshot(app, world)
    code, raw = await send(fetch, case)  # the validating fetch checked the body
    if generated:  # hypothesis' statistics; a case written out is outside a hypothesis test
        event(f"{case.method} {case.op.path} -> {code}")
    assert code < 500, f"{code} for {case}: {raw[:300]!r}"

    routed = contract.find_operation("/" + "/".join(case.parts()[2:]), None) is not None \
        and all(contract.validator(p["schema"]).is_valid(case.path_params.get(p["name"]))
                for p in case.op.parameters if p["in"] == "path")
    valid = routed and all(
        query_valid(case.query[p["name"]], p["schema"])
        for p in case.op.parameters if p["in"] == "query" and p["name"] in case.query
    )
    body_schema = case.op.request_body_schema()
    if body_schema is not None and (case.body or case.op.request_body_required()):
        limit = case.op.request_body_max_bytes()
        valid = valid and body_valid(case.body or b"", body_schema) \
            and (limit is None or len(case.body or b"") <= limit)

    change = None
    if not routed:
        assert code == 404 or (code == 403 and case.auth != "ok"), case
    elif case.method != case.op.method.upper():
        assert code == 405 or (code == 403 and case.auth != "ok"), case
    elif case.auth != "ok":
        assert code == 403, case
    elif not valid:
        assert code in (400, 404), f"{code} for an invalid request {case}: {raw[:300]!r}"
    else:
        want, change = expected_outcome(case, world)
        assert code == want, f"{code} (wanted {want}) for {case}: {raw[:300]!r}"

    after = snapshot(app, world)
    if change is None:
        assert after == before, f"{code} for {case} changed the state"
        return code
    kid = case.path_params["kernel_id"]
    for other in world.ids:
        if other != kid:
            assert after[other] == before[other], f"{case} changed another kernel"
    st_ = app.controller.get(kid)
    if change == "released":
        assert st_.state == "released" and st_.releases == before[kid][4] + 1
    elif change == "restored":
        assert st_.state == "active" and st_.restores == before[kid][5] + 1
    elif change == "restored ahead":  # the restore goes on after the answer
        await settled(app, world)
        assert st_.state == "active" and st_.restores == before[kid][5] + 1
    elif change == "pinned":
        assert st_.pinned is json.loads(case.body or b"")["pinned"]
        assert after[kid][:1] + after[kid][2:] == before[kid][:1] + before[kid][2:]
    elif change == "capped":
        asked = json.loads(case.body or b"")["memory_cap"]
        assert st_.own_cap == (None if asked is None else int(asked))
        assert after[kid] == before[kid]
    await reset(app, world)
    return code


@pytest.fixture
def world(kernels, gpushare_app, jp_fetch, jp_asyncio_loop) -> World:
    async def build() -> World:
        resident, released = await kernels.start(), await kernels.start()
        for k in (resident, released):
            await k.run("from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
                        "x = simgpu.array(np.arange(2 * 1024 * 256, dtype=np.uint32) % 89, copy=False)\n"
                        "x_sum = x.checksum()")
        await gpushare_app.poll_once()
        code, _ = await rest(jp_fetch, "POST", "kernels", released.id, "release")
        assert code == 200
        return World(resident, released, [resident.id, released.id])

    return jp_asyncio_loop.run_until_complete(build())


KNOWN_HOSTILE = [  # (method, endpoint, query, body, part of the message); each was a 500 or accepted
    # nested deeper than the recursion limit (1000 in a server; tests may run with more)
    ("PUT", "pin", {}, deep(2000), ""),
    ("PUT", "pin", {}, '{"pinned": ' + deep(1000) + "}", ""),
    ("PUT", "pin", {}, deep(100_000), "larger than"),
    ("PUT", "pin", {}, '{"pinned": NaN}', "not valid JSON"),
    ("PUT", "pin", {}, '{"pinned": false, "pinned": true}', "repeats a key"),
    ("PUT", "pin", {}, '{"pinned": true, "idle_timeout": 0}', '{"pinned": true}'),
    ("POST", "release", {}, '{"trigger": "rest"}', 'body must be empty, {} or {"trigger": "panel"}'),
    ("POST", "release", {}, '{"trigger": "panel", "why": "x"}', 'or {"trigger": "panel"}'),
    ("POST", "restore", {}, '{"trigger": null}', 'or {"trigger": "panel"}'),
    ("POST", "restore", {}, '"panel"', "must be a JSON object"),
    ("POST", "restore", {}, '{"trigger": "panel", "trigger": "panel"}', "repeats a key"),
    ("GET", None, {"seconds": "nan"}, None, "must be a number, got 'nan'"),
    ("GET", None, {"seconds": "inf"}, None, "must be a number"),
    ("GET", None, {"seconds": "1e999"}, None, "must be in (0, 604800], got 1e999"),
    ("GET", None, {"seconds": "1_000"}, None, "must be a number"),
    ("GET", None, {"seconds": " 5"}, None, "must be a number"),
    ("GET", None, {"seconds": "\u0665"}, None, "must be a number"),
    ("GET", None, {"seconds": "100%"}, None, "got '100%'"),  # a % shown as sent, not doubled
]


async def test_known_hostile_requests_are_refused_and_change_nothing(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    for method, path, params, body, message in KNOWN_HOSTILE:
        before = snapshot(gpushare_app, World(k, k, [k.id]))
        parts = ("kernels", k.id, path) if path else ("history",)
        code, answer = await rest(jp_fetch, method, *parts, params=params,
                                  body=body.encode() if body is not None else None)
        assert code == 400 and message in answer["message"], (params, (body or "")[:50], answer)
        assert snapshot(gpushare_app, World(k, k, [k.id])) == before


def test_generated_requests_never_fail_the_server_nor_change_what_they_may_not(
    world, jp_fetch, gpushare_app, jp_asyncio_loop
):
    seen: collections.Counter[str] = collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(case=cases(world))
    def one(case: Case) -> None:
        code = jp_asyncio_loop.run_until_complete(check_case(jp_fetch, gpushare_app, world, case))
        seen[f"{case.method} {case.op.path} -> {code}"] += 1

    one()

    async def data_intact() -> None:
        for k in (world.resident, world.released):  # the released one restores on this cell
            await k.run("assert x.checksum() == x_sum")
        await wait_for(lambda: gpushare_app.controller.get(world.released.id).state == "active",
                       what="the released kernel restored by its cell")

    jp_asyncio_loop.run_until_complete(data_intact())
    print(f"\n{sum(seen.values())} generated requests:")
    for key, n in sorted(seen.items()):
        print(f"  {n:5d}  {key}")
    assert sum(seen.values()) >= min(EXAMPLES, 100)


def test_restore_hints_and_restores_on_both_kernels_get_what_the_contract_says(
    world, jp_fetch, gpushare_app, jp_asyncio_loop
):
    """The generated test's restore cases, each once, on the resident and the released kernel:
    a hint (``{"trigger": "activity"}``) is answered at once (200 on a resident kernel, 202 and
    a restore in the background on a released one); a restore of a resident kernel is 409."""
    op = next(o for o in contract.operations() if o.path == "/kernels/{kernel_id}/restore")
    for body in (b'{"trigger": "activity"}', b"", b'{"trigger": "panel"}'):
        for kid in (world.resident.id, world.released.id):
            case = Case(op, "POST", {"kernel_id": kid}, {}, body, "ok")
            want, _ = expected_outcome(case, world)
            assert jp_asyncio_loop.run_until_complete(
                check_case(jp_fetch, gpushare_app, world, case, generated=False)) == want
