"""``torch.distributed.checkpoint`` (DCP) storage adapters over ppe-snapshot's format.

``dcp.save(state, storage_writer=SnapshotStorageWriter(path))`` writes an ordinary engine
snapshot, and ``dcp.load(state, storage_reader=SnapshotStorageReader(path))`` reads one,
whether DCP or ``Snapshot.take`` wrote it; DCP's planners do the resharding.

A user of the engine (it imports only ``ppe_snapshot.engine``, its format surface ``ppe_snapshot.engine.codec``,
``ppe_snapshot.storage`` and ``ppe_snapshot.errors``), beside ``writing/`` and the CLI:

* ``layout.py``: what a snapshot written through DCP holds, and which locations DCP may name;
* ``keys.py``: DCP's item keys, and the FQNs of an engine snapshot's values;
* ``writer.py``: :class:`SnapshotStorageWriter`;
* ``reader.py``: :class:`SnapshotStorageReader`.

Their old names ``ppe_snapshot.storage.SnapshotStorageWriter`` / ``SnapshotStorageReader`` still work, with a
DeprecationWarning (a shim in ``ppe_snapshot/__init__.py``).
"""
from ppe_snapshot.dcp.layout import ADAPTER_VERSION, DCP_KEY
from ppe_snapshot.dcp.reader import SnapshotStorageReader
from ppe_snapshot.dcp.writer import SnapshotStorageWriter

__all__ = ["ADAPTER_VERSION", "DCP_KEY", "SnapshotStorageReader", "SnapshotStorageWriter"]
