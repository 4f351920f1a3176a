"""Who a peer is, and what that lets it do.

The kernel says who is on the other end of every connection: ``SO_PEERCRED``
on the page channels and lifelines, and on the ZMQ socket libzmq appends the
same credentials to each message's ``Peer-Address`` (``...:uid:gid:pid``).
Nothing a client writes is taken for who it is.

- **Operators**: root, the daemon's own user, and members of the operator
  group if one is set (``KVELASTIC_OPERATOR_GROUP``). Only they may change
  limits, invalidate caches or register an engine with a guaranteed minimum.
- **Tenants**: every other uid. A tenant's engine ids and namespaces are its
  own: the daemon qualifies them with its uid (``llama@uid1000``), so two
  tenants never share an engine id (nobody can squat another's), a
  namespace, kept cache, a hand-off between replicas or a hash seed.
  Engines of root and of the daemon's user keep their names as they are.

The loop builds a ``Credential`` per connection (reading ``/proc`` for
supplementary groups only when an operator group is set); the allocator
only reads its fields.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Credential:
    uid: int
    gid: int
    pid: int
    operator: bool          # may change limits, invalidate, be guaranteed a minimum
    tenant: bool            # neither root nor the daemon's user: its names carry its uid

    def scope(self, name: str) -> str:
        """``name`` as the daemon knows it."""
        return f"{name}@uid{self.uid}" if self.tenant else name


@dataclasses.dataclass(frozen=True)
class Tenancy:
    """The daemon's rule for who is an operator."""

    daemon_uid: int = dataclasses.field(default_factory=os.geteuid)
    operator_group: int | None = None

    def credential(self, uid: int, gid: int, pid: int) -> Credential:
        trusted = uid in (0, self.daemon_uid)
        operator = trusted
        if not operator and self.operator_group is not None:
            operator = gid == self.operator_group or self.operator_group in groups_of(pid)
        return Credential(uid, gid, pid, operator, tenant=not trusted)

    def from_peer_address(self, address: str) -> Credential | None:
        """libzmq's ``Peer-Address`` of an ipc connection ends ``:uid:gid:pid``."""
        try:
            uid, gid, pid = (int(x) for x in address.rsplit(":", 3)[-3:])
        except ValueError:
            return None
        return self.credential(uid, gid, pid)


def groups_of(pid: int) -> set[int]:
    """Supplementary groups of a process (``SO_PEERCRED`` gives only the primary)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()
