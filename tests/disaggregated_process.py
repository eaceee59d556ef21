"""One side of the two-process disaggregation test (tests/test_disaggregation.py): `prefill`
prefills the prompts and sends each request's KV to `decode` through JAX's transfer
server; `decode` takes them in, decodes to the end and prints every output as JSON."""

from __future__ import annotations

import json
import sys
import time
from multiprocessing.connection import Client, Listener

from cbjax.parallel.distributed import expose_host_devices

expose_host_devices(2)

from cbjax.core import EngineArgs, build_core  # noqa: E402
from cbjax.loading import load_hf_dir  # noqa: E402
from cbjax.parallel.remote_kv import KVReceiver, KVSender, receive_prefilled, send_prefilled  # noqa: E402
from cbjax.request import Request, SamplingParams  # noqa: E402
from cbjax.runtime import kv_transfer  # noqa: E402


def main(role: str, model_dir: str, port: int, prompts_json: str, kv_cache: str) -> None:
    model = load_hf_dir(model_dir, with_tokenizer=False)
    args = EngineArgs(num_slots=4, max_seq_len=64, kv_cache=kv_cache, page_size=8, tensor_parallel=2)
    core = build_core(model, args, role=role)[1]
    done = {}
    if role == "prefill":
        sender = KVSender(core.engine)
        for _ in range(600):  # the decode side listens once its model is loaded
            try:
                conn = Client(("127.0.0.1", port), authkey=b"cbjax")
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        for i, prompt in enumerate(json.loads(prompts_json)):
            core.add(Request(str(i), prompt, SamplingParams(max_tokens=10), 0.0, seed=i))
        while core.has_unfinished():
            done.update((r.request_id, r.output_token_ids) for r in core.run_round() if r.finished)
            send_prefilled(core, sender, conn, lambda n: kv_transfer.padded_length(n, 64, 8))
        conn.send(None)
        conn.recv()  # the decode side has pulled everything: the offered arrays may go
    else:
        receiver = KVReceiver(core.engine)
        with Listener(("127.0.0.1", port), authkey=b"cbjax") as listener, listener.accept() as conn:
            backlog, finished_sending = [], False
            while not finished_sending or backlog or core.has_unfinished() or core.in_flight:
                while conn.poll(0.001 if (backlog or core.has_unfinished()) else 0.05):
                    message = conn.recv()
                    if message is None:
                        finished_sending = True
                        break
                    backlog.append(message)
                while backlog and core.scheduler.can_insert(backlog[0]["request"]) and not core.in_flight:
                    receive_prefilled(core, receiver, backlog.pop(0))
                if core.has_unfinished() or core.in_flight:  # a call run ahead is recorded too
                    done.update((r.request_id, r.output_token_ids) for r in core.run_round() if r.finished)
                else:
                    time.sleep(0.001)
            conn.send("pulled")
        assert core.stats.prefill_chunks == 0
    print("RESULT " + json.dumps(done), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
