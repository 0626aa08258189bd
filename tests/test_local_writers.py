"""The local blob writers: O_DIRECT with bounce buffers, and the buffered fallback, byte-exact."""
import os
import random

import pytest
import torch

from ppe_snapshot.engine import new_staging_buffer
from ppe_snapshot.engine.codec import tensor_bytes
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage import local
from ppe_snapshot.storage.local import _BufferedBlobWriter, _DirectBlobWriter

BOUNCE_BYTES = SETTINGS.bounce_buffer_bytes


def _random_pieces(rng: random.Random) -> list[memoryview]:
    """Pieces of awkward sizes; some page-aligned (staging buffers), some not."""
    pieces = []
    for _ in range(rng.randint(0, 30)):
        n = rng.choice([0, 1, 7, 4096, 4097, rng.randint(1, 100_000), rng.randint(1, 3 * BOUNCE_BYTES)])
        if n and rng.random() < 0.3:
            buf = new_staging_buffer(n)
            buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
            pieces.append(tensor_bytes(buf))
        else:
            pieces.append(memoryview(os.urandom(n)))
    return pieces


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_writer_output_is_byte_exact(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(SETTINGS, "direct_io", direct)
    rng = random.Random(1234)
    for case in range(12):
        pieces = _random_pieces(rng)
        path = str(tmp_path / f"f{case}")
        writer = local.open_blob_writer(path)
        assert isinstance(writer, _DirectBlobWriter if direct else _BufferedBlobWriter)
        for i in range(0, len(pieces), 3):
            writer.write(pieces[i:i + 3])
        expected = b"".join(bytes(p) for p in pieces)
        assert writer.close() == len(expected)
        with open(path, "rb") as f:
            assert f.read() == expected


def test_staging_buffer_is_page_aligned_and_zeroed():
    for size in (1, 4095, 4096, 10_000_000):
        buf = new_staging_buffer(size)
        assert buf.numel() == size and buf.data_ptr() % 4096 == 0
        assert not buf.any()


def test_direct_writer_error_surfaces_and_closes(tmp_path):
    path = str(tmp_path / "f")
    writer = local.open_blob_writer(path)
    writer.write([memoryview(b"x" * 100)])
    os.close(writer._fd)  # the disk goes away under the writer: the next flush must fail loudly
    writer._fd = os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(OSError):
        writer.write([memoryview(os.urandom(2 * BOUNCE_BYTES))])
        writer.close()
    writer.abort()
