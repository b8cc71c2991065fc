"""Multi-host runs: torchrun with the c10d rendezvous state signed by a key every node is given, so a
host on the network cannot hand the agents a pickle. ``python -m runtime.launch.signed_rendezvous``
takes torchrun's own flags, with ``--rdzv-backend partitioner-signed``.

Note [signed rendezvous state]: across hosts the rendezvous must be on TCP (a FileStore would need a
shared filesystem with working locks), and torch's c10d backend keeps its state there as base64 of
a pickle that each agent unpickles on every keep-alive (Note [no TCP rendezvous on one host] in
runtime/launch/torchrun.py). This backend is torch's c10d one with the state sealed: HMAC-SHA256
under the key in KEY_ENV (the same on every node, never on a command line) in front of the pickle,
checked before anything is unpickled, so a state written by anyone without the key is refused
(RendezvousStateError) and never loaded. What it does not cover, since torch keeps it in the same
store unsealed: the MASTER_ADDR/MASTER_PORT handed to the workers, the rank assignment (JSON), the
barriers. A host that reaches the store can still rewrite those, stall the job or make its workers
meet elsewhere, where ranks exchange JSON and tensors only (Note [no pickle between ranks] in
runtime/exchange.py): wrong values or a hang, never code (README "Trust model").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys

BACKEND = "partitioner-signed"
KEY_ENV = "PARTITIONER_RDZV_KEY"
MIN_KEY_HEX = 32  # 128 bits
_MAC = hashlib.sha256().digest_size


def rendezvous_key(environ=None) -> bytes:
    """The run's key from KEY_ENV (hex, at least MIN_KEY_HEX digits); ValueError naming the fix."""
    text = (os.environ if environ is None else environ).get(KEY_ENV, "").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(text) < MIN_KEY_HEX or not key:
        raise ValueError(f"{KEY_ENV} must hold the run's rendezvous key, at least {MIN_KEY_HEX} hex digits, the same "
                         f"on every node: e.g. export {KEY_ENV}=$(python3 -c 'import secrets; "
                         "print(secrets.token_hex(32))') on one node and copy it to the others")
    return key


def seal(key: bytes, state: bytes) -> bytes:
    return hmac.new(key, state, hashlib.sha256).digest() + state


def unseal(key: bytes, sealed: bytes) -> bytes:
    """The state under a valid seal; RendezvousStateError, before any unpickling, otherwise."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError  # lazy: loads torch

    mac, state = sealed[:_MAC], sealed[_MAC:]
    if len(sealed) < _MAC or not hmac.compare_digest(mac, hmac.new(key, state, hashlib.sha256).digest()):
        raise RendezvousStateError(f"the rendezvous state in the store is not signed with this run's {KEY_ENV}: "
                                   "another process wrote it (README \"Trust model\"); it was not loaded")
    return state


def _backend_class():
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # lazy: torch

    class SignedC10dBackend(C10dRendezvousBackend):
        """torch's c10d backend, its state sealed (Note [signed rendezvous state])."""

        def __init__(self, store, run_id: str, key: bytes):
            super().__init__(store, run_id)
            self._mac_key = key  # not _key: the base class keeps its store key there

        @property
        def name(self) -> str:
            return BACKEND

        def get_state(self):
            got = super().get_state()
            return None if got is None else (unseal(self._mac_key, got[0]), got[1])

        def set_state(self, state: bytes, token=None):
            got = super().set_state(seal(self._mac_key, state), token)
            if got is None:
                return None
            stored, token, written = got
            return unseal(self._mac_key, stored), token, written

    return SignedC10dBackend


def create_handler(params):
    """The rendezvous handler for BACKEND: torch's dynamic rendezvous on the sealed backend."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend  # lazy: torch
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic  # lazy: torch

    key = rendezvous_key()
    _, store = create_backend(params)  # torch's own store making (tcp or file, is_host, timeouts)
    return dynamic(store, _backend_class()(store, params.run_id, key), params)


def register() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry  # lazy: torch

    rendezvous_handler_registry.register(BACKEND, create_handler)


def main() -> int:
    try:
        rendezvous_key()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    register()
    from torch.distributed.elastic.rendezvous.api import RendezvousError  # lazy: loads torch after the key check
    from torch.distributed.run import main as torchrun  # lazy: as above

    try:
        torchrun()
    except RendezvousError as exc:  # a refused state among them: the job stops, said in one line
        print(f"error: the rendezvous failed ({type(exc).__name__}): {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
