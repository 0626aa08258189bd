"""Azure Blob Storage (adlfs, ``az://`` / ``abfs://`` / ``abfss://``): its retry policy, set on the client once
opened, and its upload in staged blocks committed as one block list."""
from __future__ import annotations

import io
from typing import Any

from ppe_snapshot.storage.part_stores import PartStore
from ppe_snapshot.storage.stores import StoreProfile

#: The retry policy of every Azure request (adlfs's client: data blocks, their commit, the manifest, reads and
#: listings), set on the client's retry policy of the Azure SDK (whose default waits 15 s before the first retry):
#: up to 5 attempts per request, retrying timeouts, connection errors and HTTP 408 / 500 / 502 / 503 / 504, waiting
#: 0.25 + 1.5**n s (+-0.5 s) before retry n, so that a request that keeps failing gives up after at most about
#: 15 s of waiting in all, as on S3.
AZURE_RETRIES: dict[str, float] = {"attempts": 5, "initial_backoff": 0.25, "increment_base": 1.5, "jitter": 0.5}


def use_azure_retries(fs: Any) -> None:
    """Set :data:`AZURE_RETRIES` on an adlfs file system's client (its retry policy is shared by every client
    made from it), once per cached instance."""
    client = getattr(fs, "service_client", None)
    policy = getattr(getattr(client, "_config", None), "retry_policy", None)
    if policy is None or getattr(policy, "ppe_snapshot_policy", False):
        return
    retries = int(AZURE_RETRIES["attempts"]) - 1
    policy.total_retries = policy.connect_retries = policy.read_retries = policy.status_retries = retries
    policy.initial_backoff = AZURE_RETRIES["initial_backoff"]
    policy.increment_base = AZURE_RETRIES["increment_base"]
    policy.random_jitter_range = AZURE_RETRIES["jitter"]
    policy.ppe_snapshot_policy = True


class AzureBlocks(PartStore):
    """An Azure block blob through adlfs's client: blocks staged in parallel, then one block list committed."""

    max_parts = 50_000

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        container, blob, _ = fs.split_path(path)
        self._blob = fs.service_client.get_blob_client(container, blob)

    async def put_part(self, number: int, body: io.BytesIO) -> Any:
        block_id = f"ppe-{number:08d}"  # one length for every block (the client sends it base64-encoded)
        await self._blob.stage_block(block_id, body, length=body.getbuffer().nbytes)
        return block_id

    async def complete(self, parts: list[Any]) -> None:
        from azure.storage.blob import BlobBlock

        await self._blob.commit_block_list([BlobBlock(block_id=block_id) for block_id in parts])


def _part_store(fs: Any) -> type[PartStore] | None:
    return AzureBlocks if hasattr(fs, "service_client") else None


PROFILE = StoreProfile("Azure", ("az", "abfs", "abfss"), extra="azure", package="adlfs",
                       opened=use_azure_retries, part_store=_part_store)
