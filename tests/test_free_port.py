"""``tests/helpers/launch._free_port``: the rendezvous ports the multi-process tests hand out."""

from __future__ import annotations

import socket

from tests.helpers.launch import _ephemeral_range, _free_port


def test_free_port_is_bindable_and_outside_the_kernels_ephemeral_range():
    lo, hi = _ephemeral_range()
    ports = {_free_port() for _ in range(20)}
    # bind(0) and every outgoing connection take ports of [lo, hi]: a port handed out there could be
    # taken by another test's socket before the server binds it
    assert all(p < lo for p in ports), (sorted(ports), lo, hi)
    assert len(ports) > 1  # drawn, not one fixed port for every test of a parallel run
    for port in ports:
        for host in ("127.0.0.1", "0.0.0.0"):
            with socket.socket() as s:
                s.bind((host, port))
