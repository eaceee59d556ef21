"""Prefill in one process, decode in another: a prefilled request's KV crosses processes
through JAX's transfer server (`jax.experimental.transfer`: the sender offers arrays
under a uuid, the receiver pulls them straight into its own devices' shardings; on
GPUs and TPUs the same API moves device memory over the network), and its bookkeeping
(ids, sampling, tokens so far) over a plain `multiprocessing.connection`.

    prefill process: core = build_core(model, args, role="prefill")[1]
                     sender = KVSender(core.engine); ... send_prefilled(core, sender, conn)
    decode process:  core = build_core(model, args, role="decode")[1]
                     receiver = KVReceiver(core.engine); ... receive_prefilled(core, receiver, conn)
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import transfer

from cbjax.core.kv_hand_off import held_sequence, insert_held
from cbjax.core.engine_core import EngineCore
from cbjax.request import Request
from cbjax.runtime import kv_transfer


from cbjax.runtime.scale import sharding
def _server(engine, address: str):
    client = jax.tree.leaves(engine.state)[0].devices().pop().client
    host = address.rsplit(":", 1)[0]
    return transfer.start_transfer_server(client, address, [f"{host}:0"])


class KVSender:
    def __init__(self, engine, address: str = "127.0.0.1:0"):
        self.engine = engine
        self.server = _server(engine, address)
        self._uuids = itertools.count(1)
        self._offered: dict[int, kv_transfer.SequenceKV] = {}  # kept alive until pulled

    @property
    def address(self) -> str:
        return self.server.address()

    def offer(self, seq: kv_transfer.SequenceKV) -> int:
        uuid = next(self._uuids)
        self._offered[uuid] = seq
        self.server.await_pull(uuid, jax.tree.leaves(seq))
        return uuid


class KVReceiver:
    def __init__(self, engine, address: str = "127.0.0.1:0"):
        self.engine = engine
        self.server = _server(engine, address)
        self._connections = {}

    def pull(self, address: str, uuid: int, length: int, padded: int) -> kv_transfer.SequenceKV:
        """The sequence offered under `uuid` at `address`, at this engine's shardings."""
        if address not in self._connections:
            self._connections[address] = self.server.connect(address)
        engine = self.engine
        layer = engine.cache.k[0]
        kv_shape = (layer.shape[engine.cache.head_axis], padded, layer.shape[-1])
        if engine.mesh is None:
            kv = rep = jax.sharding.SingleDeviceSharding(jax.tree.leaves(engine.state)[0].devices().pop())
        else:
            kv = sharding.kv_sharding(engine.model.config, engine.mesh, 0, 3)
            rep = sharding.replicated(engine.mesh)
        row = jax.eval_shape(lambda s: s.rows(jnp.zeros((1,), jnp.int32)), engine.state)
        layers = len(engine.cache.k)
        spec = kv_transfer.SequenceKV(
            k=(jax.ShapeDtypeStruct(kv_shape, layer.dtype, sharding=kv),) * layers,
            v=(jax.ShapeDtypeStruct(kv_shape, layer.dtype, sharding=kv),) * layers,
            state=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), row), length=length)
        leaves, tree = jax.tree.flatten(spec)
        return jax.tree.unflatten(tree, self._connections[address].pull(uuid, leaves))


def send_prefilled(core: EngineCore, sender: KVSender, conn, padded_for) -> int:
    """Offer every request `core` (a prefill instance) holds prefilled, tell the decode side
    over `conn`, and free its slot. Returns how many were sent."""
    sent = 0
    for r in core.scheduler.prefilled():
        seq = held_sequence(core, r, padded_for(r.num_tokens - 1))
        uuid = sender.offer(seq)
        conn.send({"address": sender.address, "uuid": uuid, "length": seq.length, "padded": seq.k[0].shape[1],
                   "request": dataclasses.replace(r, slot=None, fork_of=None)})
        slot = r.slot
        core.scheduler.release(r)
        core.engine.deactivate(slot)
        sent += 1
    return sent


def receive_prefilled(core: EngineCore, receiver: KVReceiver, message: dict) -> Request:
    """Insert one sent request into `core` (a decode instance with room): pull its KV, place
    it in a slot, running."""
    r: Request = message["request"]
    if not core.scheduler.can_insert(r):
        raise RuntimeError(f"no room for {r.request_id!r} on this decode instance")
    insert_held(core, r, receiver.pull(message["address"], message["uuid"], message["length"], message["padded"]))
    return r
