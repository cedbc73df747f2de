"""A layer's rows onto one EW while its experts cost less than the messages that spreading them costs.

An AW sends a layer's rows to the EWs that serve their experts. With the experts of a layer in runs over two EWs
(orchestrator/placement.py), that is two calls and two results a layer, each a write, a wake-up and a read on
both sides. Where one EW also holds a copy of every expert of the layer (with two EWs and a shadow of each expert,
either EW does), all of the layer's rows can go to it instead: one call and one result. That trades the two EWs
working in parallel for the messages. It pays while a layer's experts cost less than those messages (no compute,
or a device much faster than the wire); with the experts of this CPU, a batch of milliseconds, it does not.

So an AW measures both sides of the trade as it serves. Every result says how long the EW's batch that computed it
took (`ExpertResult.batch_s`). A layer's expert time is the sum over its calls, about what its experts cost on one
EW whichever way they went. A call's own time is how long its result took to come back, less that batch
(`EwLink.own_s`): the writes, wake-ups, reads and waits that a message costs on this machine and link. Over a window of
`WINDOW` layers the AW compares the mean expert time with the line: below it, the next window's layers each go to one
EW; above `LEAVE` times it, they are spread again (the band keeps a window near the line from flipping the next).

The line is by default the window's mean own time of a call (`below_s` None): what collapsing saves a layer is one
call. What it costs is the EWs' parallel work, at most the expert time of all EWs but one, so with two EWs a line at
one call's own time collapses while that loss is at most half the gain. The line follows the machine. On a 2-core
AVX2 VM (docs/performance.md) a layer's expert time without compute was 70-180 µs and a call's own time 300-1400 µs:
collapsed, such a layer took 0.80x / 0.78x the time at 16 / 64 streams of a fabric that held the fixed line of 100 µs
this project had before, which spread them there. With the bench model's experts on that CPU, 1.7 ms (one stream)
to 18 ms (64) against 0.7-2.4 ms, the layers stay spread. `below_s` > 0 is a fixed line instead; 0 never collapses.

While collapsed the AW does not pad: its calls say so, so the EWs' sync gathers stop waiting for it
(expert_worker/gather.py), which was the point of sending every layer to every EW. Each window measures anew, so
experts that grow costly spread the layers again within a window.

A layer's EW (`layer_targets`): of the live EWs, one holding a copy of the most experts of the layer; where several
tie, they take turns by the layer's place among the MoE layers, so that with two EWs each takes every other layer
(`--collapse-onto turns`), or the first takes every layer (`one`). Turns spread the layers' batches over the EWs, for
a host with a core for each worker. Where the workers outnumber the cores, one is faster: a step's layers then take
two processes in turn, not three, and the EW that serves every layer finds its caches as it left them, where two
that take turns each come back to caches the other processes took. On the 2-core VM, 2 AW + 2 EW with no compute,
side by side (docs/performance.md, twelfth round): 0.91x / 0.93x / 0.88x the time a layer at 1 / 16 / 64 streams,
1.11x / 1.01x / 0.95x the tokens a second, the EWs' CPU a token 0.89x; at 64 streams the slowest gaps widen, as
both AWs' calls of a layer queue at one EW. `serve` takes one where its AWs and EWs outnumber the CPUs it may use
(`--collapse-onto auto`), turns elsewhere. Every AW works it out from the same table, so a layer's calls from every
AW meet on one EW, where a batch can take them together. Experts without a copy there go where they would have
gone, and so do those the table spreads over several replicas (expert load balancing, orchestrator/balancer.py: the
operator's choice stands). A failed call is replayed the usual way, on the next live replica of each of its experts.
"""

from __future__ import annotations

import numpy as np

from fabric.routing import RoutingTable


class CollapsePolicy:
    WINDOW = 64  # layers whose mean expert time decides how the next window's layers go
    LEAVE = 1.5  # collapsed layers spread again past this many times the line

    def __init__(self, below_s: float | None = None, onto_one: bool = False) -> None:
        self.below_s = below_s  # the line: None, a call's own time, measured; > 0 fixed; 0 never collapse
        self.onto_one = onto_one  # layers that several EWs could take: all to the first (`layer_targets`)
        self.on = False
        self.collapsed = 0  # layers sent to one EW (stats)
        self.switches = 0  # times the policy changed its mind (stats)
        self.expert_s = 0.0  # the last window's mean expert time a layer (stats)
        self.line_s = below_s or 0.0  # the last window's line (stats)
        self._sum = self._own = 0.0
        self._layers = 0

    @property
    def enabled(self) -> bool:
        return self.below_s is None or self.below_s > 0

    def stats(self) -> dict[str, float | str]:
        """Its counts, and the last window's mean expert time a layer and the line it was held against."""
        return {"collapse_onto": "one" if self.onto_one else "turns",
                "collapsed_layers": self.collapsed, "collapse_switches": self.switches,
                "collapse_expert_us": round(self.expert_s * 1e6, 1), "collapse_line_us": round(self.line_s * 1e6, 1)}

    def ran(self, expert_s: float, own_s: float = 0.0) -> None:
        """Told after each layer that made calls: its calls' batch times together, and their own time (the mean)."""
        if not self.enabled:
            return
        self.collapsed += self.on
        self._sum += expert_s
        self._own += own_s
        self._layers += 1
        if self._layers >= self.WINDOW:
            self.expert_s = self._sum / self._layers
            self.line_s = self._own / self._layers if self.below_s is None else self.below_s
            on = self.expert_s < self.line_s * (self.LEAVE if self.on else 1.0)
            self.switches += on != self.on
            self.on = on
            self._sum = self._own = 0.0
            self._layers = 0


def layer_targets(table: RoutingTable, excluded: set[str], one: bool = False) -> dict[int, str]:
    """MoE layer -> the live EW (not in `excluded`) that takes the layer's rows when collapsed (see the module): of
    those tied for the most of its experts, the first (`one`) or each in turn.

    From the placement tensor in a few array ops: once per table, set of excluded EWs and switch, and a table of
    94 layers x 128 experts over 128 EWs takes ~1 ms."""
    live = [ew for ew in dict.fromkeys(table.occupants) if ew and ew not in excluded]
    if not live:
        return {}
    column = {ew: j for j, ew in enumerate(live)}
    of_slot = np.array([column.get(ew, -1) for ew in table.occupants] + [-1], dtype=np.int64)  # slot -> live EW
    p = table.placement.astype(np.int64)  # [L_moe, E, C] slot indices, -1: none (the extra last entry: no EW)
    ew = of_slot[p]  # [L_moe, E, C] live EW column, -1: none
    held = np.zeros((p.shape[0], p.shape[1], len(live) + 1), dtype=bool)  # [L_moe, E, EWs + 1]
    np.put_along_axis(held, np.where(ew >= 0, ew, len(live)), True, axis=2)  # (a copy twice on one EW counts once)
    counts = held[:, :, :-1].sum(axis=1)  # [L_moe, EWs] experts of each layer each live EW holds
    out: dict[int, str] = {}
    for i, layer in enumerate(table.layers):
        best = int(counts[i].max())
        if best:
            tied = np.flatnonzero(counts[i] == best)
            out[layer] = live[int(tied[0 if one else i % len(tied)])]
    return out
