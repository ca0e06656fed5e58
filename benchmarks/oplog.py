"""What the typed op log costs per op: encoding a forward_backward's OpRecord (control/oplog.py) for
the write-ahead log and decoding it for replay, against the protobuf wire body the log stored before;
and a ForwardBackwardResult stored as its domain value then encoded for the wire at retrieve time
(api/results.py), against encoding it once on the worker as before. No server: the codecs alone.

    python benchmarks/oplog.py --data 8 --tokens 512

Measured at the op log's commit (OMP_NUM_THREADS=1, load average 7.8 on 2 shared CPUs), best of 20:
op: wire body 66.1 kB, OpRecord 111.2 kB (tokens are int64 in the domain op, int32 on the wire, and
base64 adds a third); encode 0.31 ms, decode for replay 0.54 ms (the old replay's protobuf decode:
0.10 ms). result: protobuf 16.5 kB, domain 22.4 kB; store 0.08 ms, retrieve 0.07 ms (was 0.01 ms of
protobuf on the worker). Each is well under a millisecond against a training step of tens of ms.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from tinker import types as t
from tinker.proto.request_conv import forward_backward_request_to_proto

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's tinkerd

from tinkerd.api import codec  # noqa: E402
from tinkerd.control import oplog  # noqa: E402
from tinkerd.control.oplog import OpRecord, OpType, Payer  # noqa: E402
from tinkerd.types import ForwardBackwardResult  # noqa: E402


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=int, default=8, help="datums per forward_backward")
    p.add_argument("--tokens", type=int, default=512, help="tokens per datum")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    data = []
    for _ in range(args.data):
        toks = rng.integers(1, 50_000, args.tokens + 1).tolist()
        data.append(t.Datum(model_input=t.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * args.tokens}))
    req = t.ForwardBackwardRequest(forward_backward_input=t.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
                                   model_id="s:train:0", seq_id=1)
    wire = forward_backward_request_to_proto(req).SerializeToString()  # what the SDK sends
    op = codec.decode_forward_backward(wire)
    record = OpRecord(OpType.FORWARD_BACKWARD, op, Payer("acct", "s", "tiny"))
    stored = oplog.dumps(record)
    result = ForwardBackwardResult([{"logprobs": rng.standard_normal(args.tokens).astype(np.float32)}
                                    for _ in range(args.data)], {"loss:sum": 1.0})
    stored_result = oplog.dumps(result)
    print(f"forward_backward of {args.data} x {args.tokens} tokens; best of {args.repeats}")
    print(f"  op:     wire body {len(wire) / 1e3:.1f} kB, OpRecord {len(stored) / 1e3:.1f} kB; "
          f"encode {_best(lambda: oplog.dumps(record), args.repeats):.2f} ms, "
          f"decode (replay) {_best(lambda: oplog.loads(stored), args.repeats):.2f} ms, "
          f"wire decode (old replay) {_best(lambda: codec.decode_forward_backward(wire), args.repeats):.2f} ms")
    print(f"  result: protobuf {len(codec.encode_forward_backward_output(result)) / 1e3:.1f} kB, domain "
          f"{len(stored_result) / 1e3:.1f} kB; store {_best(lambda: oplog.dumps(result), args.repeats):.2f} ms, "
          f"retrieve (decode + protobuf) "
          f"{_best(lambda: codec.encode_forward_backward_output(oplog.loads(stored_result)), args.repeats):.2f} ms, "
          f"protobuf alone (old) {_best(lambda: codec.encode_forward_backward_output(result), args.repeats):.2f} ms")


if __name__ == "__main__":
    main()
