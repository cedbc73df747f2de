"""The typed control plane on the wire: nested records, enums and tensors round-trip, a routing
table the size of Qwen3-235B's fits in a small header, and inconsistent records are protocol
errors, never a crash later."""

from __future__ import annotations

import pytest
import torch

from fabric.errors import ProtocolError
from fabric.messages.base import Message, decode_message, encode_message
from fabric.messages.client import Attach, Submit
from fabric.messages.control import ClusterView, Register, Role, RoutingUpdate, WorkerInfo, WorkerState
from fabric.messages.expert import ExpertCall
from fabric.routing import EwAddress, RoutingTable, placement_tensor
from fabric.wire import decode_bytes, encode_bytes, parse_prefix


def roundtrip(msg: Message) -> Message:
    header, frames = encode_message(msg)
    return decode_message(*decode_bytes(encode_bytes(header, frames)))


def table(layers: int = 2, experts: int = 4, slots: int = 2, generation: int = 7, epoch: int = 3) -> RoutingTable:
    names = [f"ew-{i}" for i in range(slots)]
    placement = {(lyr, e): [names[(e + c) % slots] for c in range(2)] for lyr in range(layers) for e in range(experts)}
    return RoutingTable(generation, epoch, layers, experts, list(range(layers)), names, names,
                        [EwAddress(n, "127.0.0.1", 9000 + i) for i, n in enumerate(names)],
                        placement_tensor(list(range(layers)), experts, names, placement))


def test_cluster_view_roundtrip() -> None:
    view = ClusterView(7, table(), [WorkerInfo("aw-0", Role.ATTENTION, "h", 1, WorkerState.UNREACHABLE, 42)], ["ew-9"])
    out = roundtrip(RoutingUpdate(view))
    assert isinstance(out, RoutingUpdate)
    got = out.view
    assert got.workers == view.workers and got.workers[0].role is Role.ATTENTION and got.workers[0].serving
    assert got.dead == ["ew-9"] and got.version == (7, 3, 0)
    assert got.table is not None and got.table.replicas == view.table.replicas  # type: ignore[union-attr]
    assert got.table.primary(1, 3) == "ew-1" and got.table.primary(1, 3, {"ew-1"}) == "ew-0"


def test_register_carries_the_last_view_and_nested_messages_roundtrip() -> None:
    reg = Register(Role.EXPERT, 12, "h", 3, "ew-1", 7, ClusterView(7, None, [], []), "ew-1", [[0, 1], [1, 2]], True)
    out = roundtrip(reg)
    assert isinstance(out, Register) and out.role is Role.EXPERT and out.view is not None and out.experts == [[0, 1], [1, 2]]
    attach = Attach(Submit(request_id="r", prompt_ids=[1, 2], max_tokens=4, temperature=0.5, top_p=1.0, top_k=-1, seed=3, stop_token_ids=[2], ignore_eos=False, output_ids=[], resume_grace_s=2.0))
    assert roundtrip(attach) == attach


def test_a_qwen3_235b_sized_table_is_small() -> None:
    t = table(layers=94, experts=128, slots=64)
    header, frames = encode_message(RoutingUpdate(ClusterView(1, t, [], [])))
    data = encode_bytes(header, frames)
    header_len, _, _ = parse_prefix(data[:20])
    assert header_len < 8 << 10  # the placement travels as one int16 frame, not in the msgpack header
    assert len(data) < 64 << 10
    assert roundtrip(RoutingUpdate(ClusterView(1, t, [], []))).view.table.replicas == t.replicas  # type: ignore[attr-defined]


def _bad(header_update: dict, msg: Message | None = None) -> None:
    header, frames = encode_message(msg or RoutingUpdate(ClusterView(7, table(), [], [])))
    header.update(header_update)
    with pytest.raises(ProtocolError):
        decode_message(*decode_bytes(encode_bytes(header, frames)))


def test_inconsistent_records_are_protocol_errors() -> None:
    header, _ = encode_message(RoutingUpdate(ClusterView(7, table(), [], [])))
    view = header["view"]
    tbl = view["table"]
    _bad({"view": {**view, "workers": [{"id": "x", "role": "boss", "host": "h", "port": 1, "state": "alive"}]}})
    _bad({"view": {**view, "table": {**tbl, "occupants": ["ew-0"]}}})  # one occupant for two slots
    _bad({"view": {**view, "table": {**tbl, "occupants": ["ew-0", "ew-5"]}}})  # an occupant without an address
    _bad({"view": {**view, "table": {**tbl, "placement": ["int16", [2, 4], 0]}}})  # the wrong shape
    _bad({"view": {**view, "table": {**tbl, "layers": [0, 7]}}})  # a layer out of range
    _bad({"view": {**view, "table": "not a table"}})
    _bad({"view": {k: v for k, v in view.items() if k != "workers"}})  # a missing field
    # a placement that names a slot which does not exist
    bad = table()
    slots = bad.placement.copy()
    slots[0, 0, 0] = 5
    header, frames = encode_message(RoutingUpdate(ClusterView(7, bad, [], [])))
    frames[0] = memoryview(slots).cast("B")
    with pytest.raises(ProtocolError, match="slot"):
        decode_message(*decode_bytes(encode_bytes(header, frames)))


def test_counts_must_be_integers() -> None:
    """An expert call with float counts (it used to kill the EW) is refused by the decoder."""
    _bad({"counts": [0.5, 0.5]}, ExpertCall(1, 1, 0, [0, 1], [1, 1], torch.zeros(2, 8)))
    _bad({"counts": [True, 1]}, ExpertCall(1, 1, 0, [0, 1], [1, 1], torch.zeros(2, 8)))
