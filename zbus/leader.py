"""The leader of a multi-node cluster: its two ports, and the two halves that use them.

:class:`Leader` binds ``master_port`` (XPUB: calls, heartbeats and per-node
control, leader -> nodes) and ``master_port + 1`` (PULL: joins, heartbeats and
every remote rank's replies, nodes -> leader), then joins
:class:`zbus.membership.Membership` (formation, liveness, status: the I/O thread)
and :class:`zbus.datapath.DataPath` (calls out, replies in). It is the interface
the executor uses; the wire protocol is described in :mod:`zbus.cluster`.
"""

from __future__ import annotations

import logging
from typing import Callable

import zmq

from .cluster import ClusterSettings, check_exposure, max_reply, resolve_ip
from .curve import FRAME_SLACK, LeaderCurve, describe
from .datapath import PULL_RCVHWM, DataPath
from .failure import Failure, run_every
from .membership import Membership
from .metrics import Metrics
from .queues import Broadcaster, bind, bracket

log = logging.getLogger(__name__)
WITHDRAW_LOCK_S = 0.1  # how long a withdrawn announcement waits for the socket


class Leader:
    """The leader's side of the cluster: binds the two ports; :attr:`membership`
    admits the nodes and watches them, :attr:`path` carries the calls and the
    replies. Both share the executor's one :class:`zbus.failure.Failure`."""

    def __init__(self, settings: ClusterSettings, broadcaster_factory: Callable[..., Broadcaster],
                 failure: Failure | None = None, curve_dir: str | None = None,
                 metrics: Metrics | None = None, status: Callable[[], dict] | None = None,
                 secret: bytes | None = None, insecure: bool = False):
        self.settings = settings
        self.ctx = zmq.Context()
        self.curve: LeaderCurve | None = None
        try:
            self.bind_ip = resolve_ip(settings.master_addr)
            check_exposure(self.bind_ip, bool(secret or curve_dir), insecure)
            if secret:
                self.curve = LeaderCurve.from_secret(self.ctx, secret, settings.nnodes)
            elif curve_dir:
                self.curve = LeaderCurve.from_dir(self.ctx, curve_dir)
            configure = self.curve.server if self.curve else None
            self.bcast = broadcaster_factory(host=self.bind_ip, port=settings.master_port, ctx=self.ctx,
                                             configure=configure)
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.LINGER, 0)
            self.max_reply = max_reply()
            self.pull.setsockopt(zmq.MAXMSGSIZE, self.max_reply + FRAME_SLACK)  # (the rest is checked)
            self.pull.setsockopt(zmq.RCVHWM, PULL_RCVHWM)  # ZeroMQ's default: 1000
            if configure is not None:
                configure(self.pull)
            bind(self.pull, self.bind_ip, settings.master_port + 1)
        except BaseException:  # a port in use, bad keys: leave no thread, socket or ring behind
            if getattr(self, "bcast", None) is not None:
                self.bcast.close()
            if self.curve is not None:
                self.curve.close()
            self.ctx.destroy(linger=0)
            raise
        # the executor's own (one failure state: see zbus.failure); a leader alone makes one
        self.failure = failure if failure is not None else Failure()
        self.metrics = metrics or Metrics()
        self.path = DataPath(settings, self.bcast, self.pull, self.curve, self.metrics, self.max_reply)
        self.membership = Membership(settings, self.path, self.failure, self.metrics,
                                     f"tcp://{bracket(self.bind_ip)}:{settings.master_port + 1}", status)
        self.path.route_control(self.membership.handle, self.membership.probing_rank)
        self.xpub_lock = self.path.xpub_lock  # the executor publishes under it: heartbeats share it
        self.rpc_topic = self.path.rpc_topic  # the topic of this leader's calls
        self.receivers = self.path.receivers  # by rank, from each node's welcome on
        self.nodes = self.membership.nodes  # by node rank, once joined
        self.failure.on_failure(self._on_failure)
        (log.info if self.curve else log.warning)(
            "zbus leader on %s:%d-%d: links are %s", self.bind_ip, settings.master_port,
            settings.master_port + 1, describe(self.curve))

    def admit(self, spec: dict, torch_port: int, timeout: float, extra_env: dict | None = None,
              on_join: Callable[[int, int], None] | None = None) -> None:
        """Start the I/O thread and wait until every node joined (:meth:`Membership.admit`)."""
        self.membership.admit(spec, torch_port, timeout, extra_env, on_join)

    def start(self) -> None:
        """Start the I/O thread alone (``admit`` does it too)."""
        self.membership.start()

    def sent(self, seq: int, frames: list) -> None:
        """Call ``seq`` was queued for the nodes (the executor's sending thread): keep
        a copy to send again to a node whose connection lost it."""
        self.path.sent(seq, frames, list(self.nodes))

    def say_coming(self, seq: int, size: int, timeout: float) -> None:
        """Tell every node, before the call (on a full node's queue, once it has
        room: the call would wait for it too), that call ``seq`` of ``size`` bytes
        follows, and how many bytes this leader sends for it (a
        copy per node, on one link): see ``cluster.COMING_BYTES``. Until
        ``timeout``, or the executor's failure or shutdown."""
        self.path.tell_nodes(["coming", self.membership.session, seq, size * (self.settings.nnodes - 1)],
                             self.membership.node_ids(), timeout, self.failure.cancel)

    def withdraw_coming(self, seq: int) -> None:
        """Call ``seq``, announced, will not come (its send timed out before it
        went): to the nodes that have room now, never waiting on one (it runs as a
        send fails, a Ctrl-C's too). A full node that misses it keeps the allowance
        until the next call, which takes the same number."""
        self.path.send_beat(["coming", self.membership.session, seq, 0], self.membership.node_ids(),
                            WITHDRAW_LOCK_S)

    def try_publish_to_nodes(self, frames: list, timeout: float) -> bool:
        """Send a call to the nodes only, within ``timeout``: whether it was queued."""
        return self.path.try_publish_to_nodes(frames, timeout)

    def announce_stop(self) -> None:
        self.membership.announce_stop()

    def say_bye(self) -> bool:
        return self.membership.say_bye()

    def abort_receivers(self) -> None:
        self.path.abort_receivers()

    @property
    def calls_again(self) -> int:
        """Calls sent again to a node that lost them."""
        return self.path.calls_again

    @property
    def replies_again(self) -> int:
        """Copies of replies dropped (:attr:`DataPath.replies_again`)."""
        return self.path.replies_again

    @property
    def dropped(self) -> int:
        """Messages from the network dropped as malformed or unexpected."""
        return self.path.dropped

    @property
    def dropped_by(self) -> dict[str, int]:
        """:attr:`dropped` by reason (:attr:`DataPath.dropped_by` lists them)."""
        return self.path.dropped_by

    def _on_failure(self, _error: Exception) -> None:
        """Failed (here or in the executor: a local worker died, say): stop waiting
        for nodes and for replies."""
        with self.path.cond:
            self.path.cond.notify_all()
        self.path.wake.set()  # the I/O thread tells the nodes
        self.path.abort_receivers()

    def close(self) -> None:
        """Say bye to the nodes (best effort, bounded) and close everything; every
        step runs whatever cuts one short (a second Ctrl-C in a shutdown)."""
        bye = False
        closed: list[str] = []  # each step that closed sockets of the context

        def tell_nodes() -> None:
            nonlocal bye
            self.membership.stop()  # (again, each step: a stop cut short leaves the I/O thread on)
            self.membership.reject_joining()
            bye = self.membership.say_bye()

        def close_sockets() -> None:
            self.membership.stop()
            self.path.close(linger_s=1.0 if bye else 0.0)
            closed.append("path")

        def close_curve() -> None:
            if self.curve is not None:
                self.curve.close()
            closed.append("curve")

        def term() -> None:
            if closed == ["path", "curve"]:  # (term waits for every socket of the context)
                self.ctx.term()

        run_every(self.membership.stop, tell_nodes, close_sockets, close_curve, term)
