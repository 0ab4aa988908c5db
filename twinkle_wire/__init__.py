"""The contract both sides share: the ground floor under the server and the clients.

`twinkle_server`, `twinkle_client` and `tinker_compat` all stand on this package; it
stands on `protos/` alone. It must never import `twinkle_server`, `twinkle_client` or
torch (a torch tensor handed to the codec is read through the torch its caller already
loaded), so the server never loads its clients' SDK and a client never loads the server;
`tests/wire/test_floors.py` holds both to that. What lives here:

- `_proto`: the generated stubs, committed; `make proto` regenerates them from `protos/`
  (`_proto/generate.py`) and CI checks they are fresh.
- the codec below: the one between numpy arrays and the protobuf wire messages. Every
  conversion of a tensor or a batch of datums to or from the wire goes through it, on
  the client and on the server alike, and it holds the one `Datum`.
- `paths`: `twinkle://` (and `tinker://`) checkpoint paths and name checks.
- `values`: the plain values a client builds and the server's engine takes as they are
  (`AdamParams`, `SamplingParams`, `ServerLimits`); `stop`: Tinker's `stop` rule.

The codec does two jobs, one module each:

- `tensors`: tensor coding. Arrays travel as packed little-endian bytes plus dtype and
  shape (`encode_array`, `decode_array`: one `tobytes`/`frombuffer`, no per-element
  Python), token ids with their own checks (`token_array`, `decode_tokens`).
- `datums`: datum packing. Tinker-form `Datum`s (`encode_datum`) travel packed
  column-wise (`DatumBatch`): `pack_request` groups them under a byte budget
  (`chunk_datums`) and packs every group (`pack_datums`) before anything is sent; the
  server's `unpack_datums` validates a batch before it allocates and splits it back.

- `provenance`: which recorded sampled sequence each datum position reproduces (`Span`,
  `Provenance`), carried beside the batch (`attach_provenance`, `read_provenance`).

Every failure is a `WireError` naming the field and, where it is one datum's, the datum.
The clients' own input conventions live beside them, not here: Twinkle input features
(shifted `labels`, -100 = no loss) in `twinkle_client.features`, Tinker datums in
`tinker_compat.convert`; both reach the wire through `encode_datum` and `pack_request`.
"""

from twinkle_wire.datums import (
    DEFAULT_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    TOKEN_FIELDS,
    Datum,
    chunk_datums,
    encode_datum,
    narrow_datum,
    pack_datums,
    pack_request,
    unpack_datums,
)
from twinkle_wire.provenance import (
    Provenance,
    Span,
    attach_provenance,
    make_provenance,
    make_span,
    read_provenance,
)
from twinkle_wire.tensors import (
    MAX_DIMS,
    WireError,
    decode_array,
    decode_tokens,
    encode_array,
    token_array,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_DIMS",
    "MAX_MESSAGE_BYTES",
    "TOKEN_FIELDS",
    "Datum",
    "Provenance",
    "Span",
    "WireError",
    "attach_provenance",
    "chunk_datums",
    "decode_array",
    "decode_tokens",
    "encode_array",
    "encode_datum",
    "narrow_datum",
    "make_provenance",
    "make_span",
    "pack_datums",
    "pack_request",
    "read_provenance",
    "token_array",
    "unpack_datums",
]
