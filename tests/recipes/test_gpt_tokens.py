"""recipes/gpt over a file: its tokens written once to a token file and mapped, the same
samples as the corpus read into memory, and a process's resident memory that grows with the
batches it reads, not with the corpus (measured in a process of its own)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import torch
from torch.utils.data import default_collate

from recipes.gpt import data as gpt_data
from recipes.gpt.data import ByteBlocks, DataConfig, build_datasets, read_bytes, split
from tests.helpers import REPO, engine_env

MB = 1 << 20


def in_memory(cfg: DataConfig) -> tuple[ByteBlocks, ByteBlocks]:
    """The corpus read into memory whole, as the recipe read every file before."""
    data = torch.frombuffer(bytearray(read_bytes(cfg.path)), dtype=torch.uint8)
    train, held_out = split(data, cfg.eval_fraction)
    return ByteBlocks(train, cfg.block_size), ByteBlocks(held_out, cfg.block_size)


def test_mapped_batches_equal_the_in_memory_ones(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(os.urandom(50_000))
    cfg = DataConfig(path=str(text), block_size=48, eval_fraction=0.15)
    mapped, memory = build_datasets(cfg), in_memory(cfg)
    for a, b in zip(mapped, memory, strict=True):
        assert isinstance(a.data, gpt_data.TokenFile) and len(a) == len(b)
        for start in range(0, len(a), 16):  # batches of 16, as the loader collates them
            index = range(start, min(start + 16, len(a)))
            xa, ya = default_collate([a[i] for i in index])
            xb, yb = default_collate([b[i] for i in index])
            assert xa.dtype == xb.dtype == torch.int64
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # a worker started by spawn gets the token file's path, not the corpus
    assert len(pickle.dumps(mapped[0])) < 1000
    assert torch.equal(pickle.loads(pickle.dumps(mapped[0]))[5][0], memory[0][5][0])


def test_the_token_file_is_written_once_and_again_for_an_edited_source(tmp_path, monkeypatch):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello, tokens. " * 1000)
    cfg = DataConfig(path=str(text), block_size=16)
    writes = []
    real = gpt_data._write_tokens
    monkeypatch.setattr(gpt_data, "_write_tokens", lambda *a: writes.append(a) or real(*a))
    first = build_datasets(cfg)
    again = build_datasets(cfg)
    assert len(writes) == 1 and first[0].fingerprint() == again[0].fingerprint()
    (tokens,) = (tmp_path / ".token-cache").glob("*.u8")
    assert tokens.read_bytes() == text.read_bytes()

    text.write_bytes(b"hello, other tokens. " * 1000)
    edited = build_datasets(cfg)
    assert len(writes) == 2 and edited[0].fingerprint() != first[0].fingerprint()
    assert len(list((tmp_path / ".token-cache").glob("*.u8"))) == 1  # the stale one removed
    assert edited[0].fingerprint()["summary"].startswith(f"{round(21_000 * 0.9)} bytes")


MEASURE = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import default_collate
    from recipes.gpt.data import DataConfig, build_datasets


    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024


    before = rss()
    train, held_out = build_datasets(DataConfig(path=sys.argv[1], block_size=256))
    g = torch.Generator().manual_seed(0)
    for _ in range(8):  # a few batches of 32 blocks from all over the corpus
        x, y = default_collate([train[i] for i in torch.randint(len(train), (32,), generator=g)])
        float(x.float().mean())
    x, y = default_collate([held_out[i] for i in range(32)])
    print(rss() - before)
    """
)


def test_resident_memory_grows_with_the_batches_not_the_corpus(tmp_path):
    """64 MB of text: the token file is written, then mapped, then 9 batches read; the
    process grows by less than 16 MB (reading it into memory would add 128 MB: the bytes
    and their bytearray copy)."""
    text = tmp_path / "big.txt"
    with text.open("wb") as f:
        for k in range(64):
            line = (f"line {k} " * 40 + "\n").encode()
            f.write((line * (MB // len(line) + 1))[: MB - 4096] + os.urandom(4096))
    assert text.stat().st_size == 64 * MB
    grown = []
    for _ in ("writes the token file", "maps the one written"):
        out = subprocess.run(
            [sys.executable, "-c", MEASURE, str(text)],
            cwd=REPO,
            env=engine_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        grown.append(int(out.stdout.split()[-1]))
    assert max(grown) < 16 * MB, [g / MB for g in grown]
