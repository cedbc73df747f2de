"""The parts of `serve --cluster ray` that need no Ray cluster: node choice by failure domain,
sealed secrets, role resources, and workers following the orchestrator to a new address."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fabric.config import ExpertWorkerConfig
from fabric.errors import AuthError, ConfigError
from fabric.messages.control import Role
from launch.config import ServeConfig
from launch.ray_placement import NodeState, choose_node, spread_notes
from launch.sealing import Opener, seal


def nodes(n: int, gpus: float = 8) -> list[NodeState]:
    return [NodeState(f"node{i}", {"GPU": gpus}) for i in range(n)]


def place(ns: list[NodeState], role: Role, res: dict[str, float] | None = None,
          avoid: frozenset[str] = frozenset()) -> str:
    node = choose_node(role, res or {"GPU": 1}, ns, set(avoid))
    assert node is not None
    node.take(role, res or {"GPU": 1})
    return node.node_id


def test_attention_workers_spread_and_the_store_goes_where_they_are_not() -> None:
    ns = nodes(3)
    aws = [place(ns, Role.ATTENTION) for _ in range(2)]
    assert len(set(aws)) == 2
    store = place(ns, Role.STORE)
    assert store not in aws
    ews = [place(ns, Role.EXPERT) for _ in range(3)]
    assert len(set(ews)) == 3
    assert spread_notes(ns, 3) == []


def test_too_few_nodes_says_which_guarantee_does_not_hold() -> None:
    ns = nodes(1)
    for role in (Role.ATTENTION, Role.ATTENTION, Role.STORE, Role.EXPERT, Role.EXPERT):
        place(ns, role)
    notes = spread_notes(ns, 2)
    assert len(notes) == 3 and any("attention" in n for n in notes) and any("store" in n for n in notes)


def test_resources_bound_placement_and_avoid_is_a_preference() -> None:
    ns = nodes(2, gpus=1)
    first = place(ns, Role.EXPERT)
    second = place(ns, Role.EXPERT, avoid=frozenset({"node0", "node1"}))  # nowhere else to go: taken anyway
    assert {first, second} == {"node0", "node1"}
    assert choose_node(Role.EXPERT, {"GPU": 1}, ns) is None  # full
    assert choose_node(Role.GATEWAY, {}, ns) is not None  # no resources asked: fits anywhere
    ns[0].take(Role.EXPERT, {"GPU": 1}, -1)  # a worker gone: its GPU is free again
    assert place(ns, Role.EXPERT) == "node0"
    fresh = nodes(3)
    assert place(fresh, Role.EXPERT, avoid=frozenset({"node0", "node1"})) == "node2"


def test_sealed_box_opens_only_for_its_recipient() -> None:
    alice, eve = Opener(), Opener()
    box = seal(alice.public, b"the cluster secret")
    assert b"the cluster secret" not in box
    assert alice.open(box) == b"the cluster secret"
    assert seal(alice.public, b"x") != seal(alice.public, b"x")  # fresh key and nonce each time
    with pytest.raises(AuthError):
        eve.open(box)
    with pytest.raises(AuthError):
        alice.open(box[:-1] + bytes([box[-1] ^ 1]))  # altered
    with pytest.raises(AuthError):
        alice.open(b"short")


def test_role_resources_are_checked() -> None:
    cfg = ServeConfig(cluster="ray", aw_resources='{"GPU": 1, "fabric": 0.5}')
    assert cfg.resources("aw_resources") == {"GPU": 1.0, "fabric": 0.5}
    for bad in ('{"GPU": -1}', "[1]", "{GPU: 1}", '{"GPU": true}', '{"GPU": "1"}'):
        with pytest.raises(ConfigError):
            ServeConfig(cluster="ray", ew_resources=bad)
    with pytest.raises(ConfigError):
        ServeConfig(ray_address="127.0.0.1:6379")  # (--cluster local)


def test_gpu_workers_on_ray_take_a_gpu_from_ray() -> None:
    """On Ray a GPU worker's GPU is Ray's to pick (CUDA_VISIBLE_DEVICES, which its process inherits)."""
    cfg = ServeConfig(cluster="ray", device="cuda", ew_resources='{"GPU": 0.5}')
    assert cfg.resources("aw_resources") == {"GPU": 1.0} and cfg.resources("ew_resources") == {"GPU": 0.5}
    assert cfg.resources("store_resources") == {} and cfg.resources("gateway_resources") == {}
    assert ServeConfig(cluster="ray").resources("aw_resources") == {}  # (CPU workers: no GPU asked for)
    assert ServeConfig(device="cuda").resources("aw_resources") == {}  # (--cluster local hands GPUs out itself)
    with pytest.raises(ConfigError, match="share of a GPU"):
        ServeConfig(cluster="ray", device="cuda", aw_resources='{"GPU": 0}')
    with pytest.raises(ConfigError, match="say --device cuda"):
        ServeConfig(cluster="ray", device="cuda:1")


def test_a_worker_follows_the_orchestrator_file(tmp_path: Path) -> None:
    """The address file wins once it exists; a half-written or missing one falls back."""
    path = tmp_path / "orchestrator"
    cfg = ExpertWorkerConfig(model="m", orchestrator="127.0.0.1:7000", orchestrator_file=str(path))
    assert cfg.orchestrator_addr == ("127.0.0.1", 7000)
    path.write_text("10.0.0.9:7001\n")
    assert cfg.orchestrator_addr == ("10.0.0.9", 7001)
    path.write_text("10.0.0.9:")
    assert cfg.orchestrator_addr == ("127.0.0.1", 7000)


def test_the_control_link_dials_the_newest_address(tmp_path: Path) -> None:
    """Each reconnection asks for the address again: a link whose orchestrator moved dials the new one."""
    from aiohttp import web

    from fabric.control_link import ControlLink
    from fabric.messages.control import Register

    async def scenario() -> list[str]:
        seen: list[str] = []

        async def ws(request: web.Request) -> web.StreamResponse:
            seen.append(request.host)
            sock = web.WebSocketResponse()
            await sock.prepare(request)
            await sock.close()  # drop it: the link reconnects
            return sock

        app = web.Application()
        app.router.add_get("/ws", ws)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        where = ["127.0.0.2"]  # first the wrong address (nothing listens there), then the right one
        link = ControlLink(lambda: (where[0], port), lambda: Register(Role.EXPERT, 1, "127.0.0.1", 1), lambda m: None)
        task = asyncio.create_task(link.run())
        await asyncio.sleep(0.3)
        where[0] = "127.0.0.1"
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.05)
        task.cancel()
        await runner.cleanup()
        return seen

    seen = asyncio.run(scenario())
    assert seen and seen[0].startswith("127.0.0.1:")
